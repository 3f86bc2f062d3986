"""Attention's inputs in one kernel: per-head RMSNorm of q and k, rotary embedding, the KV write.

The fused qkv projection's output `[T, (H + 2G) * D]` (q heads, then k heads, then v heads, one
device's share) goes in; q `[T, H, D]` normed and rotated comes out, k (normed, rotated) and v
`[T, G, D]` come out (a prompt chunk's attention reads its own tokens from them) and are written
into their page slots in place (pages aliased to the outputs, as in `write_kv.py`).
In XLA these are several small kernels per layer (norm reductions and products, the rotary
slices and concatenations, the scatter), each a launch and a gap in the decode step; here one
(what it saved: NOTES.md).

One program per (token, head): q head j for j < H, else KV head j - H, whose k and v it writes (a
padding token's, slot < 0, only to the token outputs). A head's D channels are loaded as the two rotary halves,
so the rotation needs no shuffle. Rounding follows `reference.norm_rope_write` step by step: the
normalised row rounded to the activation dtype before the weight (Qwen3 / Llama) or after it
(zero-centred weights, Qwen3-Next), the rotation in float32 from the rounded normed values.
Full rotary only (rotary dim = D) and no output gate: other layouts take the unfused path.

Lowering: Triton (vectors of D / 2 per program; runs in CPU interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.rms_norm.kernel import scale

ANY = pl.BlockSpec(memory_space=pl.ANY)


def supported(head_dim: int, rotary_dim: int) -> bool:
    """Shapes the kernel takes: full rotary, D a power of two of at least 16 (Triton vectors)."""
    return rotary_dim == head_dim and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _norm(x1, x2, w_ref, *, eps, zero_centred, dtype, head_dim):
    """RMSNorm of one head's halves (float32 in, float32 of the rounded result out)."""
    half = head_dim // 2
    w1 = w_ref[pl.ds(0, half)].astype(jnp.float32)
    w2 = w_ref[pl.ds(half, half)].astype(jnp.float32)
    r = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / head_dim + eps)
    y1 = scale(x1 * r, w1, dtype=dtype, zero_centred=zero_centred)
    y2 = scale(x2 * r, w2, dtype=dtype, zero_centred=zero_centred)
    return y1.astype(jnp.float32), y2.astype(jnp.float32)


def _kernel(slot_ref, qkv_ref, cos_ref, sin_ref, *rest, num_heads, num_kv_heads, head_dim, eps, zero_centred,
            norm):
    if norm:
        qw_ref, kw_ref, _, _, q_out, k_tok, v_tok, k_out, v_out = rest
    else:
        qw_ref = kw_ref = None
        _, _, q_out, k_tok, v_tok, k_out, v_out = rest  # the page inputs are aliased to k_out / v_out
    t, j = pl.program_id(0), pl.program_id(1)
    half = head_dim // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    dtype = q_out.dtype

    def rotated(col0, w_ref):
        x1 = qkv_ref[t, pl.ds(col0, half)].astype(jnp.float32)
        x2 = qkv_ref[t, pl.ds(col0 + half, half)].astype(jnp.float32)
        if norm:
            x1, x2 = _norm(x1, x2, w_ref, eps=eps, zero_centred=zero_centred, dtype=dtype, head_dim=head_dim)
        c1, c2 = cos_ref[t, lo], cos_ref[t, hi]
        s1, s2 = sin_ref[t, lo], sin_ref[t, hi]
        return (x1 * c1 + (-x2) * s1).astype(dtype), (x2 * c2 + x1 * s2).astype(dtype)

    @pl.when(j < num_heads)
    def _():
        o1, o2 = rotated(j * head_dim, qw_ref)
        q_out[t, j, lo] = o1
        q_out[t, j, hi] = o2

    slot = slot_ref[t]

    @pl.when(j >= num_heads)
    def _():
        g = j - num_heads
        o1, o2 = rotated((num_heads + g) * head_dim, kw_ref)
        v = qkv_ref[t, pl.ds((num_heads + num_kv_heads + g) * head_dim, head_dim)]
        k_tok[t, g, lo] = o1
        k_tok[t, g, hi] = o2
        v_tok[t, g, pl.ds(0, head_dim)] = v

        @pl.when(slot >= 0)
        def _():
            k_out[slot, g, lo] = o1.astype(k_out.dtype)
            k_out[slot, g, hi] = o2.astype(k_out.dtype)
            v_out[slot, g, pl.ds(0, head_dim)] = v.astype(v_out.dtype)


def norm_rope_write(qkv, cos, sin, q_norm, k_norm, k_pages, v_pages, slot_mapping, *, num_heads: int, eps: float,
                    zero_centred: bool, interpret: bool = False):
    """Same arguments and results as `reference.norm_rope_write`, plus `interpret`."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_tokens = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or not supported(head_dim, cos.shape[-1]):
        raise ValueError(f"norm_rope_write: qkv {qkv.shape}, cos {cos.shape} and pages {k_pages.shape} do not make "
                         f"{num_heads} q heads and {num_kv_heads} KV heads of {head_dim} with full rotary")
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    norm = q_norm is not None
    weights = (q_norm, k_norm) if norm else ()
    kernel = functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               eps=float(eps), zero_centred=zero_centred, norm=norm)
    first_page = 4 + len(weights)
    tok = jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim), qkv.dtype)
    q, k, v, k_flat, v_flat = pl.pallas_call(
        kernel,
        grid=(num_tokens, num_heads + num_kv_heads),
        in_specs=[ANY] * (first_page + 2),
        out_specs=[ANY] * 5,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), qkv.dtype), tok, tok,
                   jax.ShapeDtypeStruct(flat, k_pages.dtype), jax.ShapeDtypeStruct(flat, v_pages.dtype)],
        input_output_aliases={first_page: 3, first_page + 1: 4},
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="norm_rope_write_kv",
    )(slot_mapping.astype(jnp.int32), qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), *weights,
      k_pages.reshape(flat), v_pages.reshape(flat))
    return q, k, v, k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)
