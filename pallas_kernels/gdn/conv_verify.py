"""Causal conv1d + SiLU for speculative draft tokens on a chain or a tree.

Token j's window is its parent's window shifted by one with x_j appended (parent -1: the committed
window in the slot). One program per (request, channel block) keeps every draft token's window in
registers as K-1 column vectors (a few registers each), picks the parent's by a chain of selects,
and writes each window to scratch `[B, N, C, K-1]`; the pool is only read.

Faster than the reference's XLA version at verify shapes (figures in NOTES.md).

Lowering: Triton (memory-bound, per-request indirection; runs in CPU interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gdn.common import ANY, cdiv, load, store, triton_params
from pallas_kernels.gdn.conv import channel_mask


def _conv_verify_kernel(slots_ref, parents_ref, x_ref, w_ref, pool_ref, y_ref, scratch_ref, *, num_draft,
                        block_c):
    channels = x_ref.shape[1]
    width = w_ref.shape[1]
    b = pl.program_id(0)
    cs = pl.ds(pl.program_id(1) * block_c, block_c)
    c_live = channel_mask(channels, block_c, pl.program_id(1))
    slot = slots_ref[b]
    weights = [load(w_ref.at[cs, jnp.int32(i)], c_live).astype(jnp.float32) for i in range(width)]
    committed = [load(pool_ref.at[slot, cs, jnp.int32(i)], c_live).astype(x_ref.dtype)
                 for i in range(width - 1)]
    windows = []  # windows[j]: token j's K-1 newest inputs, oldest first
    for j in range(num_draft):
        t = b * num_draft + j
        p = parents_ref[b, j]
        parent = committed
        for jj in range(j):
            parent = [jnp.where(p == jj, new, old) for new, old in zip(windows[jj], parent)]
        full = parent + [load(x_ref.at[t, cs], c_live)]
        acc = sum(full[i].astype(jnp.float32) * weights[i] for i in range(width))
        store(y_ref.at[t, cs], (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype), c_live)
        windows.append(full[1:])
        for i in range(width - 1):
            store(scratch_ref.at[b, jnp.int32(j), cs, jnp.int32(i)], full[1 + i].astype(scratch_ref.dtype), c_live)


def causal_conv1d_verify(x, weight, conv_pool, slots, parents, *, interpret=False, block_c=256, num_warps=4):
    """Pallas version of `reference.causal_conv1d_verify` (same arguments and results)."""
    batch, num_draft = parents.shape
    channels = x.shape[1]
    keep = conv_pool.shape[2]
    return pl.pallas_call(
        functools.partial(_conv_verify_kernel, num_draft=num_draft, block_c=block_c),
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((batch, num_draft, channels, keep), conv_pool.dtype),
        ),
        grid=(batch, cdiv(channels, block_c)),
        in_specs=[ANY] * 5,
        out_specs=[ANY] * 2,
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="gdn_conv1d_verify",
    )(slots.astype(jnp.int32), parents.astype(jnp.int32), x, weight, conv_pool)
