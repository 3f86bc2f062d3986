"""The fused q / k RMSNorm + rotary + KV write kernel (interpret mode) against the reference's
steps: bit for bit in 16-bit activations, within float32 rounding of the norm's sum in float32;
with and without gates and partial rotary; padding tokens write nothing into the pages (their k /
v rows still come out), other slots stay as they were (NaN included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import reference as ref


def rotary(positions, dim):
    inv = 1.0 / (10000.0 ** (np.arange(0, dim, 2) / dim))
    freqs = positions[:, None].astype(np.float32) * inv[None].astype(np.float32)
    emb = np.concatenate([freqs, freqs], -1)
    return jnp.asarray(np.cos(emb)), jnp.asarray(np.sin(emb))


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,norm,zero_centred,rotary_dim,gated", [
    (4, 2, 32, jnp.bfloat16, True, False, 32, False),  # Qwen3
    (3, 3, 64, jnp.bfloat16, True, False, 64, False),  # head counts that are not powers of two
    (4, 1, 32, jnp.bfloat16, False, False, 32, False),  # Llama: no q / k norm
    (2, 2, 32, jnp.bfloat16, True, True, 32, False),  # zero-centred weights
    (4, 2, 32, jnp.float32, True, False, 32, False),
    (4, 2, 64, jnp.bfloat16, True, True, 16, True),  # Qwen3-Next: gates, a quarter of D rotated
    (2, 1, 32, jnp.bfloat16, False, False, 8, True),
    (4, 2, 32, jnp.float32, True, True, 8, True),
])
def test_norm_rope_write_matches_reference(heads, kv_heads, head_dim, dtype, norm, zero_centred, rotary_dim, gated):
    rng = np.random.default_rng(heads * head_dim + rotary_dim)
    pages, page_size, tokens = 6, 4, 5
    q_width = head_dim * (2 if gated else 1)
    qkv = jnp.asarray(rng.standard_normal((tokens, heads * q_width + 2 * kv_heads * head_dim)), dtype)
    cos, sin = rotary(rng.integers(0, 4000, tokens), rotary_dim)
    centre = 0.0 if zero_centred else 1.0
    q_w, k_w = ((jnp.asarray(rng.standard_normal(head_dim) * 0.2 + centre, dtype) for _ in range(2)) if norm
                else (None, None))
    k_pages = rng.standard_normal((pages, page_size, kv_heads, head_dim))
    k_pages[rng.random((pages, page_size)) < 0.3] = np.nan  # untouched slots must stay as they were
    k_pages = jnp.asarray(k_pages, dtype)
    v_pages = jnp.asarray(rng.standard_normal((pages, page_size, kv_heads, head_dim)), dtype)
    slots = jnp.asarray([3, -1, 7, 20, 0], jnp.int32)  # one padding token
    kw = dict(num_heads=heads, eps=1e-6, zero_centred=zero_centred, gated=gated)
    want = ref.norm_rope_write(qkv, cos, sin, q_w, k_w, k_pages, v_pages, slots, **kw)
    fn = jax.jit(lambda *a: pa.norm_rope_write(*a, **kw, interpret=True), donate_argnums=(5, 6))
    got = fn(qkv, cos, sin, q_w, k_w, jnp.array(k_pages), jnp.array(v_pages), slots)
    for name, w, g in zip(("q", "k", "v", "k_pages", "v_pages"), want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        w, g = np.asarray(w.astype(jnp.float32)), np.asarray(g.astype(jnp.float32))
        if dtype == jnp.float32:  # the norm's sum in another order: float32 rounding
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


def test_norm_rope_write_rejects_shapes_it_does_not_take():
    pages = jnp.zeros((2, 4, 1, 32), jnp.bfloat16)
    qkv = jnp.zeros((3, 6 * 32), jnp.bfloat16)
    cos = sin = jnp.zeros((3, 12))  # a rotary dim that is not a power of two
    assert not pa.norm_rope_supported(32, 12) and not pa.norm_rope_supported(8, 8) and pa.norm_rope_supported(128, 128)
    assert pa.norm_rope_supported(256, 64) and not pa.norm_rope_supported(32, 4) and not pa.norm_rope_supported(96, 96)
    with pytest.raises(ValueError, match="power-of-two rotary dim"):
        pa.norm_rope_write(qkv, cos, sin, None, None, pages, pages, jnp.zeros(3, jnp.int32), num_heads=4, eps=1e-6,
                           zero_centred=False, interpret=True)
