"""Pallas KV write (interpret mode) against the reference scatter, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import reference as ref


@pytest.mark.parametrize("G", [2, 3])  # 3: the per-head path for non-power-of-two G
def test_write_kv_matches_reference(G):
    rng = np.random.default_rng()
    P, L, D, T = 12, 4, 16, 10
    k = rng.standard_normal((P, L, G, D)).astype(np.float32)
    v = rng.standard_normal((P, L, G, D)).astype(np.float32)
    k[rng.random((P, L)) < 0.3] = np.nan  # untouched slots must stay exactly as they were
    slots = rng.permutation(P * L)[:T].astype(np.int32)
    slots[[0, 4, 9]] = -1  # padding tokens
    k_new = rng.standard_normal((T, G, D)).astype(np.float32)
    v_new = rng.standard_normal((T, G, D)).astype(np.float32)
    args = [jnp.asarray(x) for x in (k, v, k_new, v_new, slots)]
    expected = ref.write_kv(*args)
    fn = jax.jit(lambda *a: pa.write_kv(*a, interpret=True), donate_argnums=(0, 1))
    out = fn(*[jnp.array(a) for a in args])
    for o, e in zip(out, expected):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(e))  # NaN == NaN here


def test_write_kv_casts_to_cache_dtype():
    rng = np.random.default_rng()
    k = jnp.asarray(rng.standard_normal((4, 4, 2, 8)), jnp.bfloat16)
    new = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    slots = jnp.asarray([5, -1, 0], jnp.int32)
    out_k, out_v = pa.write_kv(k, k, new, new, slots, interpret=True)
    exp_k, _ = ref.write_kv(k, k, new, new, slots)
    assert out_k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out_k.astype(jnp.float32)), np.asarray(exp_k.astype(jnp.float32)))


@pytest.mark.parametrize("slot", [6, -1])
def test_reference_one_token_write(slot):
    """The reference's one-token path (padded to two rows, the second dropped) against numpy,
    jitted with the pages donated as the engine calls it."""
    rng = np.random.default_rng(slot + 10)
    k = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    v = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    new_k = rng.standard_normal((1, 2, 8)).astype(np.float32)
    new_v = rng.standard_normal((1, 2, 8)).astype(np.float32)
    want_k, want_v = k.reshape(12, 2, 8).copy(), v.reshape(12, 2, 8).copy()
    if slot >= 0:
        want_k[slot], want_v[slot] = new_k[0], new_v[0]
    fn = jax.jit(ref.write_kv, donate_argnums=(0, 1))
    out_k, out_v = fn(jnp.asarray(k), jnp.asarray(v), jnp.asarray(new_k), jnp.asarray(new_v),
                      jnp.asarray([slot], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out_k), want_k.reshape(k.shape))
    np.testing.assert_array_equal(np.asarray(out_v), want_v.reshape(v.shape))
