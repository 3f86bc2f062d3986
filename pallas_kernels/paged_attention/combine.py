"""Merge flash-decoding partials across KV splits.

Split s of a row left (acc_s, m_s, l_s) with acc_s = sum_j 2^(x_j - m_s) v_j and l_s the same sum
without v, in the log2 domain. Rescaling every split to the common max M gives
out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. A split that saw nothing has m_s = -inf and
weight 0; a row that saw nothing anywhere gets 0 (not 0/0).

`combine_splits` is the jnp merge of any query block's rows (XLA fuses it, in two to four kernels
depending on the split count). `combine_decode` is the same merge for decode, where a block holds
one token and only its first `group` rows are query heads: one Pallas kernel reads those rows of
every split and writes the heads `[B, H, D]` directly, so decode's merge and row pick cost one
launch per layer instead of XLA's several (NOTES.md, "combine.py").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# f32 elements of acc one loop step of `combine_decode` holds (splits x rows x D): 32 per thread of
# four warps, so the partials stay in registers whatever the split count.
_CHUNK_ELEMENTS = 4096


def combine_splits(acc, m, l, dtype):
    """acc `[NB, G, S, M, D]`, m and l `[NB, G, S, M]` -> `[NB, G, M, D]` in `dtype`."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp2(m - m_all)  # [NB, G, S, M]
    num = jnp.sum(w[..., None] * acc, axis=2)
    den = jnp.sum(w * l, axis=2)
    return (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(dtype)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def combine_decode_supported(splits: int, rows: int, group: int) -> bool:
    """Triton blocks are powers of two: the split count and the query heads per KV head must be."""
    return _pow2(splits) and _pow2(group) and group <= rows


def _decode_kernel(acc_ref, m_ref, l_ref, o_ref, *, chunk: int):
    # acc_ref [S, R, BD], m_ref / l_ref [S, R] (R = the group's rows), o_ref [R, BD].
    splits = m_ref.shape[0]
    m_all = jnp.max(m_ref[...], axis=0)  # [R]
    m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    den = jnp.sum(jnp.exp2(m_ref[...] - m_all[None, :]) * l_ref[...], axis=0)

    def step(c, num):
        w = jnp.exp2(m_ref[pl.ds(c * chunk, chunk), :] - m_all[None, :])  # [C, R]
        return num + jnp.sum(w[:, :, None] * acc_ref[pl.ds(c * chunk, chunk), :, :], axis=0)

    num = jax.lax.fori_loop(0, splits // chunk, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = (num / jnp.where(den > 0, den, 1.0)[:, None]).astype(o_ref.dtype)


def combine_decode(acc, m, l, group: int, dtype, *, interpret: bool = False):
    """acc `[B, G, S, M, D]`, m and l `[B, G, S, M]` of decode blocks (row r < group of KV head g
    is query head g * group + r; the rest pad the MMA tile) -> `[B, G * group, D]` in `dtype`.
    Needs `combine_decode_supported`."""
    batch, num_kv_heads, splits, rows, head_dim = acc.shape
    if not combine_decode_supported(splits, rows, group):
        raise ValueError(f"combine_decode: splits ({splits}) and group ({group}) must be powers of two, "
                         f"group <= rows ({rows})")
    # Programs also split D, so the few (request, KV head) pairs of a small batch still spread
    # over many SMs; each holds at most `_CHUNK_ELEMENTS` partials per loop step.
    block_d = head_dim
    while block_d > 16 and splits * group * block_d > _CHUNK_ELEMENTS and head_dim % (block_d // 2) == 0:
        block_d //= 2
    chunk = max(1, min(splits, _CHUNK_ELEMENTS // (group * block_d)))
    while splits % chunk:  # both powers of two: keep chunk a divisor
        chunk //= 2
    out = pl.pallas_call(
        functools.partial(_decode_kernel, chunk=chunk),
        grid=(batch, num_kv_heads, head_dim // block_d),
        in_specs=[
            pl.BlockSpec((None, None, splits, group, block_d), lambda b, g, d: (b, g, 0, 0, d)),
            pl.BlockSpec((None, None, splits, group), lambda b, g, d: (b, g, 0, 0)),
            pl.BlockSpec((None, None, splits, group), lambda b, g, d: (b, g, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, group, block_d), lambda b, g, d: (b, g, 0, d)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), dtype),
        interpret=interpret,
        name="paged_decode_combine",
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
    )(acc, m, l)
    return out.reshape(batch, num_kv_heads * group, head_dim)
