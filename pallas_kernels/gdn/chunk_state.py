"""Chunked prefill, part 2: carry the state across a sequence's chunks and emit the output.

One program per (request, value head, dv block) walks its request's chunks in order with the state
block `S [dk, BV]` (float32) in registers; per chunk, with the terms of `chunk_prepare.py`:
    delta = u - w @ S
    o     = qs * (q @ S) + Aqk @ delta
    S     = exp(gc_last) S + k^T @ (ks * delta)
Only `w @ S -> delta -> k^T @ delta` is on the loop-carried path; `q @ S` and `Aqk @ delta` hang off it.
Output and state update live in one kernel so the per-chunk states never go to memory (flash-linear-
attention writes them, 32 KiB per chunk and head, and reads them back in a separate output kernel).

The dots take 16-bit operands (the state is rounded to the input dtype for them, as in
flash-linear-attention) with float32 accumulation; the carried state stays float32.

An extra row of programs (request index B) writes zeros to the padding tokens past cu_seqlens[B].

Measured (H200, jax 0.11.2, bench/results/kernels_gdn_h200.json): 0.24 ms at 1x8192 tokens, 0.32 ms at 8x2048 with
BV = 64, 4 warps, 3 pipeline stages (the best of the sweep in the JSON; 4 stages exceed shared memory,
8 warps and BV = 32 are slower at 8x2048).

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
    cu_ref, slots_ref, init_ref, q_ref, k_ref, w_ref, u_ref, aqk_ref, qs_ref, ks_ref, gc_ref, pool_ref,
    o_ref, pool_out_ref,
    *, block_v, group,
):
    b = pl.program_id(0)
    h = pl.program_id(1)
    jv = pl.program_id(2)
    batch = pl.num_programs(0) - 1
    hk = h // group
    num_tokens = q_ref.shape[0]
    dk = q_ref.shape[-1]
    cols = pl.ds(jv * block_v, block_v)
    idx = jnp.arange(CHUNK)

    @pl.when(b < batch)
    def _():
        r0 = cu_ref[b]
        n = cu_ref[b + 1] - r0

        @pl.when(n > 0)
        def _():
            slot = slots_ref[b]
            # A fresh request starts from zeros: its slot may hold anything, so it is not read.
            s0 = plt.load(pool_ref.at[slot, h, :, cols], mask=splat(init_ref[b] != 0, (dk, block_v)),
                          other=0.0)

            def chunk(c, s):
                rows = pl.ds(r0 + c * CHUNK, CHUNK)
                live = c * CHUNK + idx < n
                mk = row_mask(live, dk)
                mv = row_mask(live, block_v)
                w = plt.load(w_ref.at[h, rows, :], mask=mk, other=0.0)
                q = plt.load(q_ref.at[rows, hk, :], mask=mk, other=0.0)
                k = plt.load(k_ref.at[rows, hk, :], mask=mk, other=0.0)
                u = plt.load(u_ref.at[h, rows, cols], mask=mv, other=0.0)
                a = plt.load(aqk_ref.at[h, rows, :], mask=row_mask(live, CHUNK), other=0.0)
                qs = plt.load(qs_ref.at[h, rows], mask=live, other=0.0)
                ks = plt.load(ks_ref.at[h, rows], mask=live, other=0.0)
                g_last = gc_ref[h, r0 + jnp.minimum(c * CHUNK + CHUNK, n) - 1]

                s_mm = s.astype(w.dtype)
                delta = u.astype(jnp.float32) - dot(w, s_mm)
                out = qs[:, None] * dot(q, s.astype(q.dtype)) + dot(a, delta.astype(a.dtype))
                plt.store(o_ref.at[rows, h, cols], out.astype(o_ref.dtype), mask=mv)
                return jnp.exp(g_last) * s + dot(k, (ks[:, None] * delta).astype(k.dtype), trans_a=True)

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


def chunk_state(q, k, w, u, aqk, qs, ks, gc, state_pool, cu_seqlens, slots, has_initial, *, block_v,
                num_warps=4, num_stages=2, interpret=False):
    """Returns (o `[T, Hv, dv]` in q's dtype, state_pool updated in place)."""
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, _, dv = u.shape
    batch = slots.shape[0]
    kernel = functools.partial(_state_kernel, block_v=block_v, group=num_v_heads // num_k_heads)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, num_v_heads, dv), q.dtype),
            jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        ),
        grid=(batch + 1, num_v_heads, dv // block_v),
        in_specs=[ANY] * 12,
        out_specs=[ANY] * 2,
        input_output_aliases={11: 1},
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_chunk_state",
    )(cu_seqlens, slots, has_initial.astype(jnp.int32), q, k, w, u, aqk, qs, ks, gc, state_pool)
