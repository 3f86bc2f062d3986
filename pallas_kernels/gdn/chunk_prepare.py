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

Measured (H200, jax 0.11.2, bench/results/kernels_gdn_h200.json): 0.31 ms at 1x8192 tokens (0.20 ms of it without the
triangular inverse), 0.59 ms at 8x2048; 4 warps (2 warps: 2.2x slower, 8 warps: 2.4x slower).

Lowering: Triton. Mosaic GPU kernels cannot run in CPU interpret mode, and this kernel is a handful
of 64x64 tensor-core dots plus masked loads over ragged chunks, which Triton expresses directly. No
Mosaic GPU variant was written, so the choice is not a measured comparison.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.common import ANY, CHUNK, dot, inv_norm, row_mask, triton_params

def unit_lower_inverse(a):
    """(I + a)^{-1} for a strictly lower-triangular `[64, 64]` float32 `a`, in 10 dots.

    Blocked doubling. If D inverts the diagonal blocks of size b of I + a, then the diagonal blocks
    of size 2b (two b-blocks and the lower-left part E of a between them) have the inverse
        [[D1, 0], [-D2 E D1, D2]] = D - D E D.
    Size-2 blocks need no dot ([[1, 0], [x, 1]]^{-1} = [[1, 0], [-x, 1]]); then 2 -> 4 -> ... -> 64
    takes two dots per level. All dots are 64x64 (the zero blocks ride along, tensor cores don't
    mind), and the ten are one dependent chain.

    Why this form: it stays at ~1e-3 relative error with tf32 dots even for strongly correlated keys
    (on the CPU: float32 exact), like row-by-row substitution (which costs one dependent dot per row
    block: 18 dots here in a first version, measured 0.41 ms for the prepare kernel at 8192 tokens on
    an H200), while the single-level product (I - a)(I + a^2)(I + a^4)... loses all precision when
    keys are correlated (powers of a blow up; relative error 1e11 seen with emulated tf32).
    """
    n = a.shape[0]
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    d = jnp.where(i == j, 1.0, 0.0).astype(jnp.float32) - jnp.where(i // 2 == j // 2, a, 0.0)
    b = 2
    while b < n:
        e = jnp.where(((i // (2 * b)) == (j // (2 * b))) & ((i // b) != (j // b)), a, 0.0)
        d = d - dot(dot(d, e), d)
        b *= 2
    return d


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
        mk = row_mask(live, dk)
        mv = row_mask(live, dv)
        q = plt.load(q_ref.at[rows, hk, :], mask=mk, other=0.0)
        k = plt.load(k_ref.at[rows, hk, :], mask=mk, other=0.0)
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

        # Outputs that don't need the inverse go out first, so their tiles are dead during it.
        aqk = rq[:, None] * dot(q, k, trans_b=True) * rk[None, :] * decay
        plt.store(aqk_ref.at[h, rows, :], aqk.astype(cd), mask=row_mask(live, CHUNK))
        plt.store(qs_ref.at[h, rows], rq * jnp.exp(gc), mask=live)
        plt.store(ks_ref.at[h, rows], rk * jnp.exp(g_last - gc), mask=live)
        plt.store(gc_ref.at[h, rows], gc, mask=live)

        a = jnp.where(i > j, (beta * rk)[:, None] * dot(k, k, trans_b=True) * rk[None, :] * decay, 0.0)
        t = unit_lower_inverse(a)
        # Column scales of (I + A)^{-1} instead of row scales of k / v: 64x64 instead of 64 x d.
        w = dot((t * (beta * jnp.exp(gc) * rk)[None, :]).astype(cd), k)
        plt.store(w_ref.at[h, rows, :], w.astype(cd), mask=mk)
        v = plt.load(v_ref.at[rows, h, :], mask=mv, other=0.0).astype(cd)
        u = dot((t * beta[None, :]).astype(cd), v)
        plt.store(u_ref.at[h, rows, :], u.astype(cd), mask=mv)


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
