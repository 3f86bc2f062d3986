"""Chunked prefill, part 1: everything inside a chunk of 64 tokens that does not need the state.

Within a chunk (rows i, j), with q, k L2-normalised, gc the chunk-local cumulative sum of g and
A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j) for j < i, the delta rule's per-token corrections
delta = (I + A)^{-1} (beta v - beta exp(gc) k S_0) split into a state-free part and a state term
(the WY / UT form):
    u = (I + A)^{-1} diag(beta) v              -> delta = u - w @ S_0
    w = (I + A)^{-1} diag(beta exp(gc)) k
and the chunk's output and final state are
    o     = diag(exp(gc)) q @ S_0 + Aqk @ delta,   Aqk[i, j] = (q_i . k_j) exp(gc_i - gc_j), j <= i
    S_end = exp(gc_last) S_0 + (diag(exp(gc_last - gc)) k)^T @ delta.
This kernel computes w, u, Aqk and three per-token scale vectors for every chunk independently (one
program per (chunk, value head), so the whole prefill fills the GPU); `chunk_state.py` then carries
the state across chunks.

The raw (un-normalised) q and k are what the dots consume: normalisation is a per-row scale, and it
is cheaper to scale the 64x64 results (or the small vectors) than the 64 x dk operands.

Lowering: Triton. Mosaic GPU kernels cannot run in CPU interpret mode, and this kernel is a handful
of 64x64 tensor-core dots plus masked gathers over ragged chunks, which Triton handles directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.common import ANY, CHUNK, dot, full_mask, inv_norm, triton_params

# The unit-lower-triangular inverse works on diagonal sub-blocks of this size (see below).
SUB = 16


def unit_lower_inverse(a):
    """(I + a)^{-1} for a strictly lower-triangular `[64, 64]` float32 `a`.

    Why blocked: the textbook product (I - a)(I + a^2)(I + a^4)... uses only dots but loses all
    precision when keys are correlated (powers of `a` blow up; measured relative error 1e11 with
    tf32 dots), while this form stays near 1e-3 with tf32 dots (on the CPU: float32 exact):
    1. forward substitution inside the four 16x16 diagonal blocks, all four at once (row s of every
       block per step, each step one dot; 14 steps);
    2. with D the block-diagonal inverse and E the below-diagonal blocks, I + a = (I + L)(I + M),
       M = D E is strictly block-lower with four blocks, so M^4 = 0 and
       (I + a)^{-1} = (I - M + M^2 - M^3) D.
    """
    n = a.shape[0]
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    same_block = (i // SUB) == (j // SUB)
    eye = jnp.where(i == j, 1.0, 0.0).astype(jnp.float32)
    # x = D - I. Row s of a block: x_s = -a_s - a_s @ x, which only needs rows < s (already final).
    x = jnp.where(same_block, -a, 0.0)
    for s in range(2, SUB):
        sel = (i % SUB) == s
        rows = jnp.where(sel, x, 0.0)  # still -a on these rows
        x = jnp.where(sel, rows + dot(rows, x), x)
    d = eye + x
    m = dot(d, jnp.where(same_block, 0.0, a))
    series = eye - dot(m, eye - dot(m, eye - m))  # Horner form of I - M + M^2 - M^3
    return dot(series, d)


def _prepare_kernel(
    cstart_ref, clen_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,  # inputs
    w_ref, u_ref, aqk_ref, qs_ref, ks_ref, gc_ref,  # outputs
    *, scale, use_qk_l2norm, group,
):
    c = pl.program_id(0)
    h = pl.program_id(1)
    hk = h // group
    n = clen_ref[c]
    dk = q_ref.shape[-1]
    dv = v_ref.shape[-1]
    cd = w_ref.dtype

    @pl.when(n > 0)
    def _():
        r0 = cstart_ref[c]
        rows = pl.ds(r0, CHUNK)
        idx = jnp.arange(CHUNK)
        live = idx < n
        mk = full_mask(live, jnp.arange(dk) < dk)
        mv = full_mask(live, jnp.arange(dv) < dv)
        q = plt.load(q_ref.at[rows, hk, :], mask=mk, other=0.0)
        k = plt.load(k_ref.at[rows, hk, :], mask=mk, other=0.0)
        v = plt.load(v_ref.at[rows, h, :], mask=mv, other=0.0).astype(cd)
        g = plt.load(g_ref.at[rows, h], mask=live, other=0.0).astype(jnp.float32)
        beta = plt.load(beta_ref.at[rows, h], mask=live, other=0.0).astype(jnp.float32)

        if use_qk_l2norm:
            rq = inv_norm(q.astype(jnp.float32)) * scale
            rk = inv_norm(k.astype(jnp.float32))
        else:
            rq = jnp.full((CHUNK,), scale, jnp.float32)
            rk = jnp.ones((CHUNK,), jnp.float32)
        q = q.astype(cd)
        k = k.astype(cd)

        gc = jnp.cumsum(g)  # dead rows add 0, so gc[63] is the last live row's
        g_last = jnp.sum(g)
        i = idx[:, None]
        j = idx[None, :]
        causal = i >= j
        # exp only where j <= i: there gc_i - gc_j <= 0 for g <= 0; elsewhere it could overflow.
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)

        kk = dot(k, k, trans_b=True)
        a = jnp.where(i > j, (beta * rk)[:, None] * kk * rk[None, :] * decay, 0.0)
        qk = dot(q, k, trans_b=True)
        aqk = rq[:, None] * qk * rk[None, :] * decay

        t = unit_lower_inverse(a)
        # Column scales of (I + A)^{-1} instead of row scales of k / v: 64x64 instead of 64 x d.
        w = dot((t * (beta * jnp.exp(gc) * rk)[None, :]).astype(cd), k)
        u = dot((t * beta[None, :]).astype(cd), v)

        plt.store(w_ref.at[h, rows, :], w.astype(cd), mask=mk)
        plt.store(u_ref.at[h, rows, :], u.astype(cd), mask=mv)
        plt.store(aqk_ref.at[h, rows, :], aqk.astype(cd), mask=full_mask(live, idx < CHUNK))
        plt.store(qs_ref.at[h, rows], rq * jnp.exp(gc), mask=live)
        plt.store(ks_ref.at[h, rows], rk * jnp.exp(g_last - gc), mask=live)
        plt.store(gc_ref.at[h, rows], gc, mask=live)


def chunk_prepare(q, k, v, g, beta, chunk_start, chunk_len, *, scale, use_qk_l2norm, mm_dtype,
                  num_warps=4, num_stages=1, interpret=False):
    """Per-chunk WY terms. chunk_start / chunk_len `[NC]`: first token and length (0 = unused) of
    every chunk slot. Returns (w `[Hv, T, dk]`, u `[Hv, T, dv]`, aqk `[Hv, T, 64]` in mm_dtype;
    qs, ks, gc `[Hv, T]` float32), each row written only for tokens inside a chunk.

    qs = scale * |q|^-1 * exp(gc), ks = |k|^-1 * exp(gc_last - gc): row scales of the raw q / k dots
    in the state pass; gc: chunk-local cumulative log decay (the state pass reads the last one).
    """
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    kernel = functools.partial(_prepare_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               group=num_v_heads // num_k_heads)
    out_shape = (
        jax.ShapeDtypeStruct((num_v_heads, num_tokens, dk), mm_dtype),
        jax.ShapeDtypeStruct((num_v_heads, num_tokens, dv), mm_dtype),
        jax.ShapeDtypeStruct((num_v_heads, num_tokens, CHUNK), mm_dtype),
        jax.ShapeDtypeStruct((num_v_heads, num_tokens), jnp.float32),
        jax.ShapeDtypeStruct((num_v_heads, num_tokens), jnp.float32),
        jax.ShapeDtypeStruct((num_v_heads, num_tokens), jnp.float32),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(chunk_start.shape[0], num_v_heads),
        in_specs=[ANY] * 7,
        out_specs=[ANY] * 6,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_chunk_prepare",
    )(chunk_start, chunk_len, q, k, v, g, beta)
