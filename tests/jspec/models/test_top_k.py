"""`ops.top_k`: lax.top_k's values, ids and tie order, in pieces narrow enough for XLA's GPU
selection kernel (a wider top-k is a full sort of every row there): chunks of few long rows, passes
over many rows."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models import ops


@pytest.mark.parametrize("k", [1, 16, 17, 20, 33, 40])
def test_top_k_equals_lax_top_k_with_ties_and_minus_inf(k):
    rng = np.random.default_rng(k)
    fn = jax.jit(lambda x: ops.top_k(x, k))
    passes = jax.jit(lambda x: ops.top_k_in_passes(x, k))
    chunked = jax.jit(lambda x: ops.top_k_chunked(x, k, chunk=max(k, 64)))
    for trial in range(12):
        rows = [1, 3, ops.TOP_K_CHUNKED_MAX_ROWS, ops.TOP_K_CHUNKED_MAX_ROWS + 5][trial % 4]
        n = int(rng.integers(48, 3 * ops.TOP_K_CHUNK))  # below and above two chunks
        x = rng.integers(-4, 4, size=(rows, n)).astype(np.float32)  # few distinct values: many ties
        x[rng.random((rows, n)) < 0.3] = -np.inf
        if trial % 3 == 0:  # fewer finite entries than k: the rest is -inf, ranked by id
            x[:] = -np.inf
            x[:, rng.integers(0, n, 3)] = 1.0
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        for f in (fn, passes, chunked):
            vals, ids = f(jnp.asarray(x))
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
            np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))


@pytest.mark.parametrize("rows,n,widths", [
    (4, 4096, [16, 4, 16, 4]),  # few long rows: chunks, then their candidates, each in passes
    (ops.TOP_K_CHUNKED_MAX_ROWS, 4096, [16, 4, 16, 4]),
    (ops.TOP_K_CHUNKED_MAX_ROWS + 1, 4096, [16, 4]),  # many rows: passes
    (4, 2 * ops.TOP_K_CHUNK - 1, [20]),  # short rows: one top-k
])
def test_wide_top_k_lowers_to_pieces_of_at_most_sixteen(rows, n, widths):
    text = jax.jit(lambda x: ops.vocab_top_k(x, 20)).lower(jnp.zeros((rows, n), jnp.float32)).as_text()
    assert [int(k) for k in re.findall(r"top_k\(.*?k = (\d+)", text)] == widths
