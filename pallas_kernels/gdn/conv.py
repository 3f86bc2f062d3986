"""Ragged causal depthwise conv1d + SiLU over new tokens, continuing each request's window.

Two launches, because within one the programs that read a slot's old window (tokens near the start
of a request) and the program that writes its new window (the request's end) could run in any order:
1. `_conv_kernel`, one program per (token block, channel block): tap i of token t reads input
   t - (K-1) + i, from this step's x when that is inside the token's request, else from the slot's
   stored window (zeros for a fresh request). Gathers do the shifting, so no input is copied.
2. `_window_kernel`, one program per (request, channel block): the last K-1 inputs before the
   request's end (older ones from the old window when the request is shorter than K-1) become the
   slot's window. Requests without tokens write nothing.

Values follow the reference's rounding: the stored window is cast to x's dtype before use, the
products and sum are float32, y is cast back to x's dtype.

The shifted gathers per tap are the cost; 32 tokens x 128 channels per program was the best of five
block shapes timed. Figures, against the reference's XLA version: NOTES.md.

Lowering: Triton. The kernel is a memory-bound gather-and-multiply; Triton's pointer gathers with
masks express the per-token window routing directly and run in CPU interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.common import ANY, cdiv, full_mask, load, row_mask, splat, store, triton_params


def channel_mask(channels: int, block_c: int, program):
    """Live channels `[block_c]` of a channel block, or None when the blocks tile C exactly: then the
    masks vary along rows only and Triton keeps its loads and stores wide."""
    if channels % block_c == 0:
        return None
    return program * block_c + jnp.arange(block_c) < channels


def _rows_and_channels(rows, c_live, block_c):
    return row_mask(rows, block_c) if c_live is None else full_mask(rows, c_live)


def _splat_and_channels(cond, c_live, block_c):
    m = splat(cond, (block_c,))
    return m if c_live is None else m & c_live


def _conv_kernel(req_ref, cu_ref, slots_ref, init_ref, x_ref, w_ref, pool_ref, y_ref, *, block_t, block_c):
    num_tokens, channels = x_ref.shape
    width = w_ref.shape[1]
    batch = slots_ref.shape[0]
    t = pl.program_id(0) * block_t + jnp.arange(block_t)
    ch = pl.program_id(1) * block_c + jnp.arange(block_c)
    cs = pl.ds(pl.program_id(1) * block_c, block_c)
    t_live = t < num_tokens
    c_live = channel_mask(channels, block_c, pl.program_id(1))
    req = plt.load(req_ref.at[pl.ds(pl.program_id(0) * block_t, block_t)], mask=t_live, other=batch)
    valid = req < batch
    req = jnp.minimum(req, batch - 1)
    start = cu_ref[req]
    slot = slots_ref[req]
    fresh = init_ref[req] == 0
    shape = (block_t, block_c)
    chb = jnp.broadcast_to(ch[None, :], shape)

    acc = jnp.zeros(shape, jnp.float32)
    for i in range(width):
        src = t - (width - 1) + i
        from_x = src >= start
        x_mask = _rows_and_channels(valid & from_x, c_live, block_c)
        xv = plt.load(x_ref.at[jnp.broadcast_to(src[:, None], shape), chb], mask=x_mask, other=0.0)
        h_mask = _rows_and_channels(valid & ~from_x & ~fresh, c_live, block_c)
        col = jnp.clip((width - 1) + src - start, 0, width - 2)
        hv = plt.load(pool_ref.at[jnp.broadcast_to(slot[:, None], shape), chb,
                                  jnp.broadcast_to(col[:, None], shape)], mask=h_mask, other=0.0)
        tap = xv.astype(jnp.float32) + hv.astype(x_ref.dtype).astype(jnp.float32)
        wi = load(w_ref.at[cs, jnp.int32(i)], c_live)
        acc = acc + tap * wi.astype(jnp.float32)[None, :]
    y = acc * jax.nn.sigmoid(acc)
    y = jnp.where(valid[:, None], y, 0.0)
    plt.store(y_ref.at[pl.ds(pl.program_id(0) * block_t, block_t), cs], y.astype(y_ref.dtype),
              mask=_rows_and_channels(t_live, c_live, block_c))


def _window_kernel(cu_ref, slots_ref, init_ref, x_ref, pool_ref, pool_out_ref, *, block_c, barrier):
    channels = x_ref.shape[1]
    keep = pool_ref.shape[2]  # K - 1
    b = pl.program_id(0)
    cs = pl.ds(pl.program_id(1) * block_c, block_c)
    c_live = channel_mask(channels, block_c, pl.program_id(1))
    r0 = cu_ref[b]
    r1 = cu_ref[b + 1]

    @pl.when(r1 > r0)
    def _():
        slot = slots_ref[b]
        fresh = init_ref[b] == 0
        cols = []
        for i in range(keep):  # read everything first: the old window is overwritten below
            src = r1 - keep + i
            from_x = src >= r0
            xv = plt.load(x_ref.at[jnp.maximum(src, 0), cs], mask=_splat_and_channels(from_x, c_live, block_c),
                          other=0.0)
            old = plt.load(pool_ref.at[slot, cs, jnp.clip(keep + src - r0, 0, keep - 1)],
                           mask=_splat_and_channels(~from_x & ~fresh, c_live, block_c), other=0.0)
            cols.append(xv + old.astype(x_ref.dtype))
        if barrier:
            plt.debug_barrier()
        for i in range(keep):
            store(pool_out_ref.at[slot, cs, jnp.int32(i)], cols[i].astype(pool_out_ref.dtype), c_live)


def causal_conv1d(x, weight, conv_pool, cu_seqlens, slots, has_initial, *, interpret=False, block_t=32,
                  block_c=128, num_warps=4):
    """Pallas version of `reference.causal_conv1d` (same arguments and results)."""
    num_tokens, channels = x.shape
    batch = slots.shape[0]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    slots = slots.astype(jnp.int32)
    init = has_initial.astype(jnp.int32)
    # Request of every token (B for padding), as reference.token_request_index, in one fusion.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.sum(cu_seqlens[1:][None, :] <= t[:, None], axis=1, dtype=jnp.int32)
    y = pl.pallas_call(
        functools.partial(_conv_kernel, block_t=block_t, block_c=block_c),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(cdiv(num_tokens, block_t), cdiv(channels, block_c)),
        in_specs=[ANY] * 7,
        out_specs=ANY,
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="gdn_conv1d",
    )(req, cu_seqlens, slots, init, x, weight, conv_pool)
    window_block = 512
    conv_pool = pl.pallas_call(
        functools.partial(_window_kernel, block_c=window_block, barrier=not interpret),
        out_shape=jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
        grid=(batch, cdiv(channels, window_block)),
        in_specs=[ANY] * 5,
        out_specs=ANY,
        input_output_aliases={4: 0},
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="gdn_conv1d_window",
    )(cu_seqlens, slots, init, x, conv_pool)
    return y, conv_pool
