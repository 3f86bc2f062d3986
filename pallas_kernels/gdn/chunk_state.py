"""Chunked prefill, part 2: carry the state across a sequence's chunks and emit the output.

One program per (request, value head, dv block) walks its request's chunks in order with the state
block `S [dk, BV]` (float32) in registers; per chunk, with the terms of `chunk_prepare.py`, either
(per-chunk WY form)
    delta = u - w @ S
    o     = qs * (q @ S) + Aqk @ delta
or (stacked form: one 128-row dot gives both)
    [delta; o] = [u; ou] - [w; qw] @ S
and then
    S     = exp(gc_last) S + k^T @ (ks * delta).
Only `w @ S -> delta -> k^T @ delta` is on the loop-carried path, but Triton waits for every dot
before the next, so the per-chunk form's `q @ S` and `Aqk @ delta` lengthen the chain as well: at
1x8192 tokens (64 or 128 programs, one per multiprocessor) the chain's length is the kernel's time,
which is why the stacked form exists. Output and state update live in one kernel so the per-chunk
states never go to memory (flash-linear-attention writes them, 32 KiB per chunk and head, and reads
them back in a separate output kernel).

The dots take 16-bit operands (the state is rounded to the input dtype for them, as in
flash-linear-attention) with float32 accumulation; the carried state stays float32.

With `chunk_saves` (a pool row per chunk slot, -1 for none) the state after a chunk is also stored
into that row as the loop passes it: prefix-cache snapshots inside a prompt chunk, at no cost but
the store, since the state is in registers there anyway.

An extra row of programs (request index B) writes zeros to the padding tokens past cu_seqlens[B].

BV, warps and stages are chosen by `chunk.ChunkConfig`; the figures behind them: NOTES.md.

Lowering: Triton. A sequential loop of small dots over ragged, slot-indirected data with masked tails
is what Triton's pointer model expresses directly, and the same kernel runs in CPU interpret mode. No
Mosaic GPU variant was written, so the choice is not a measured comparison.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.common import ANY, CHUNK, cdiv, dot, row_mask, splat, triton_params


def _state_kernel(
    cu_ref, slot0_ref, slots_ref, init_ref, q_ref, k_ref, *refs, block_v, group, stacked, saves,
):
    # refs: the chunk terms (stacked: wq, uo, ks, gl; else w, u, aqk, qs, ks, gl), with `saves` the
    # snapshot row of each chunk slot, then the pool, then the outputs o and the pool (aliased).
    *terms, pool_ref, o_ref, pool_out_ref = refs
    save_ref = terms.pop() if saves else None
    b = pl.program_id(0)
    h = pl.program_id(1)
    jv = pl.program_id(2)
    batch = pl.num_programs(0) - 1
    hk = h // group
    num_tokens = o_ref.shape[0]
    dk = k_ref.shape[-1]
    cols = pl.ds(jv * block_v, block_v)
    idx = jnp.arange(CHUNK)

    @pl.when(b < batch)
    def _():
        r0 = cu_ref[b]
        n = cu_ref[b + 1] - r0
        first = slot0_ref[b]

        @pl.when(n > 0)
        def _():
            slot = slots_ref[b]
            # A fresh request starts from zeros: its slot may hold anything, so it is not read.
            s0 = plt.load(pool_ref.at[slot, h, :, cols], mask=splat(init_ref[b] != 0, (dk, block_v)),
                          other=0.0)

            def chunk(c, s):
                rows = pl.ds(r0 + c * CHUNK, CHUNK)
                live = c * CHUNK + idx < n
                cs = first + c
                ks = terms[-2][h, cs]
                g_last = terms[-1][h, cs]
                k = plt.load(k_ref.at[rows, hk, :], mask=row_mask(live, dk), other=0.0)
                s_mm = s.astype(k.dtype)
                # Chunk-slot tiles are whole (rows past the chunk's end are zero): no masks.
                if stacked:
                    wq_ref, uo_ref = terms[:2]
                    # [delta; o] = [u; Aqk u] - [w; Aqk w - qs q] @ S: one 128-row dot.
                    delta, out = jnp.split(
                        uo_ref[h, cs, :, cols].astype(jnp.float32) - dot(wq_ref[h, cs], s_mm), 2, axis=0)
                else:
                    w_ref, u_ref, aqk_ref, qs_ref = terms[:4]
                    q = plt.load(q_ref.at[rows, hk, :], mask=row_mask(live, dk), other=0.0)
                    delta = u_ref[h, cs, :, cols].astype(jnp.float32) - dot(w_ref[h, cs], s_mm)
                    out = qs_ref[h, cs][:, None] * dot(q, s_mm) + dot(aqk_ref[h, cs], delta.astype(k.dtype))
                plt.store(o_ref.at[rows, h, cols], out.astype(o_ref.dtype), mask=row_mask(live, block_v))
                s = jnp.exp(g_last) * s + dot(k, (ks[:, None] * delta).astype(k.dtype), trans_a=True)
                if save_ref is not None:  # a prefix-cache snapshot of the state after this chunk
                    row = save_ref[cs]
                    plt.store(pool_out_ref.at[jnp.maximum(row, 0), h, :, cols], s,
                              mask=splat(row >= 0, (dk, block_v)))
                return s

            s = jax.lax.fori_loop(0, cdiv(n, CHUNK), chunk, s0)
            plt.store(pool_out_ref.at[slot, h, :, cols], s)

    @pl.when(b == batch)
    def _():
        r0 = cu_ref[batch]
        zeros = jnp.zeros((CHUNK, block_v), o_ref.dtype)

        def pad(c, carry):
            rows = pl.ds(r0 + c * CHUNK, CHUNK)
            plt.store(o_ref.at[rows, h, cols], zeros, mask=row_mask(r0 + c * CHUNK + idx < num_tokens, block_v))
            return carry

        jax.lax.fori_loop(0, cdiv(num_tokens - r0, CHUNK), pad, 0)


def chunk_state(q, k, terms, state_pool, cu_seqlens, slot0, slots, has_initial, *, block_v, out_dtype,
                num_warps=4, num_stages=2, interpret=False, chunk_saves=None):
    """q, k `[T, Hk, dk]` (mm dtype), `terms` = what `chunk_prepare` returned (its `stacked` form is
    told by their count), slot0 `[B]` (each request's first chunk slot). Returns (o `[T, Hv, dv]` in
    out_dtype, state_pool updated in place). chunk_saves `[chunk slots]` int32 (optional, -1 = none):
    the state after each chunk slot's tokens also goes to that pool row."""
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads = terms[0].shape[0]
    dv = terms[1].shape[-1]
    batch = slots.shape[0]
    stacked = len(terms) == 4
    saves = chunk_saves is not None
    kernel = functools.partial(_state_kernel, block_v=block_v, group=num_v_heads // num_k_heads, stacked=stacked,
                               saves=saves)
    extra = (chunk_saves.astype(jnp.int32),) if saves else ()
    args = (cu_seqlens, slot0, slots, has_initial.astype(jnp.int32), q, k, *terms, *extra, state_pool)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, num_v_heads, dv), out_dtype),
            jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        ),
        grid=(batch + 1, num_v_heads, dv // block_v),
        in_specs=[ANY] * len(args),
        out_specs=[ANY] * 2,
        input_output_aliases={len(args) - 1: 1},
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_chunk_state",
    )(*args)
