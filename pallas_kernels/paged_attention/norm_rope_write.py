"""Attention's inputs in one kernel: per-head RMSNorm of q and k, rotary embedding, the KV write.

The fused qkv projection's output `[T, H * Dq + 2G * D]` (q heads of Dq = D, or 2D with their
gates, then k heads, then v heads, one device's share) goes in; q `[T, H, D]` normed and rotated
comes out, k (normed, rotated) and v `[T, G, D]` come out (a prompt chunk's attention reads its
own tokens from them) and are written into their page slots in place (pages aliased to the
outputs, as in `write_kv.py`).
In XLA these are several small kernels per layer (norm reductions and products, the rotary
slices and concatenations, the scatter), each a launch and a gap in the decode step; here one
(what it saved: NOTES.md).

One program per (token, head): q head j for j < H, else KV head j - H, whose k and v it writes (a
padding token's, slot < 0, only to the token outputs). The rotary channels are loaded as their two
halves, so the rotation needs no shuffle; with partial rotary (Qwen3-Next: a quarter of D) the
whole head is loaded once more for the norm and the channels past the rotary dim. Rounding
follows `reference.norm_rope_write` step by step: the normalised row rounded to the activation
dtype before the weight (Qwen3 / Llama) or after it (zero-centred weights, Qwen3-Next), the
rotation in float32 from the rounded normed values.
`gated`: q heads interleave [query D | gate D] in the projection (Qwen3-Next / Qwen3.5); the
kernel reads the query halves, the caller takes the gates. Rotary dims that are not powers of two
take the unfused path.

Lowering: Triton (vectors of half the rotary dim, and of D with partial rotary; runs in CPU
interpret mode).
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
    """Shapes the kernel takes: D a power of two of at least 16, the rotary dim a power of two of 8
    to D (Triton vectors are powers of two: D, and half the rotary dim)."""
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return head_dim >= 16 and pow2(head_dim) and 8 <= rotary_dim <= head_dim and pow2(rotary_dim)


def _kernel(slot_ref, qkv_ref, cos_ref, sin_ref, *rest, num_heads, num_kv_heads, head_dim, rotary_dim, q_width,
            eps, zero_centred, norm):
    if norm:
        qw_ref, kw_ref, _, _, q_out, k_tok, v_tok, k_out, v_out = rest
    else:
        qw_ref = kw_ref = None
        _, _, q_out, k_tok, v_tok, k_out, v_out = rest  # the page inputs are aliased to k_out / v_out
    t, j = pl.program_id(0), pl.program_id(1)
    rh = rotary_dim // 2
    dtype = q_out.dtype
    f32 = jnp.float32

    def pieces(col0, w_ref):
        """One head's output channels as (slice, values, mask): the rotary halves rotated, and with
        partial rotary the whole head (normed) stored where no rotary channel is."""
        x1 = qkv_ref[t, pl.ds(col0, rh)].astype(f32)
        x2 = qkv_ref[t, pl.ds(col0 + rh, rh)].astype(f32)
        rest = []
        if rotary_dim == head_dim:
            ss = jnp.sum(x1 * x1) + jnp.sum(x2 * x2)
        else:
            x = qkv_ref[t, pl.ds(col0, head_dim)].astype(f32)
            ss = jnp.sum(x * x)
        if norm:  # rounded to the activation dtype before the rotation, as the reference's steps
            r = jax.lax.rsqrt(ss / head_dim + eps)

            def normed(v, start, n):
                w = w_ref[pl.ds(start, n)].astype(f32)
                return scale(v * r, w, dtype=dtype, zero_centred=zero_centred).astype(f32)

            x1, x2 = normed(x1, 0, rh), normed(x2, rh, rh)
        if rotary_dim < head_dim:
            y = normed(x, 0, head_dim) if norm else x
            past = jax.lax.broadcasted_iota(jnp.int32, (head_dim,), 0) >= rotary_dim
            rest = [(pl.ds(0, head_dim), y, past)]
        lo, hi = pl.ds(0, rh), pl.ds(rh, rh)
        c1, c2, s1, s2 = cos_ref[t, lo], cos_ref[t, hi], sin_ref[t, lo], sin_ref[t, hi]
        return [(lo, x1 * c1 + (-x2) * s1, None), (hi, x2 * c2 + x1 * s2, None)] + rest

    def put(ref, row, head, parts):
        for cols, val, mask in parts:  # the slices never overlap: no order between them needed
            if mask is None:
                ref[row, head, cols] = val.astype(dtype).astype(ref.dtype)
            else:
                plt.store(ref.at[row, head, cols], val.astype(dtype).astype(ref.dtype), mask=mask)

    @pl.when(j < num_heads)
    def _():
        put(q_out, t, j, pieces(j * q_width, qw_ref))

    slot = slot_ref[t]

    @pl.when(j >= num_heads)
    def _():
        g = j - num_heads
        k_parts = pieces(num_heads * q_width + g * head_dim, kw_ref)
        v = qkv_ref[t, pl.ds(num_heads * q_width + (num_kv_heads + g) * head_dim, head_dim)]
        put(k_tok, t, g, k_parts)
        v_tok[t, g, pl.ds(0, head_dim)] = v

        @pl.when(slot >= 0)
        def _():
            put(k_out, slot, g, k_parts)
            v_out[slot, g, pl.ds(0, head_dim)] = v.astype(v_out.dtype)


def norm_rope_write(qkv, cos, sin, q_norm, k_norm, k_pages, v_pages, slot_mapping, *, num_heads: int, eps: float,
                    zero_centred: bool, gated: bool = False, interpret: bool = False):
    """Same arguments and results as `reference.norm_rope_write`, plus `interpret`."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_tokens = qkv.shape[0]
    q_width = head_dim * (2 if gated else 1)
    if qkv.shape[1] != num_heads * q_width + 2 * num_kv_heads * head_dim or not supported(head_dim, cos.shape[-1]):
        raise ValueError(f"norm_rope_write: qkv {qkv.shape}, cos {cos.shape} and pages {k_pages.shape} do not make "
                         f"{num_heads} q heads{' with gates' if gated else ''} and {num_kv_heads} KV heads of "
                         f"{head_dim} with a power-of-two rotary dim of 8 to {head_dim}")
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    norm = q_norm is not None
    weights = (q_norm, k_norm) if norm else ()
    kernel = functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               rotary_dim=cos.shape[-1], q_width=q_width, eps=float(eps), zero_centred=zero_centred,
                               norm=norm)
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
