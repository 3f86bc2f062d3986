"""`ops.top_k` and `ops.vocab_top_k` on each kernel backend (the Pallas kernel in interpret mode,
lax.top_k as the reference): lax.top_k's values, ids and tie order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models import dispatch, ops


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_vocab_top_k_equals_lax_top_k_on_each_backend(backend):
    rng = np.random.default_rng(1)
    x = rng.integers(-4, 4, size=(5, 5000)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    with dispatch.use_backend(backend):
        fn = jax.jit(lambda x: (ops.top_k(x, 20), ops.vocab_top_k(x, 7)))
        text = fn.lower(jnp.asarray(x)).as_text()
        (vals, ids), (vals7, ids7) = fn(jnp.asarray(x))
    assert ("chlo.top_k" in text) == (backend == "reference")  # the kernel path has no XLA top-k
    for (got_vals, got_ids), k in (((vals, ids), 20), ((vals7, ids7), 7)):
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
        np.testing.assert_array_equal(np.asarray(got_vals), np.asarray(want_vals))
