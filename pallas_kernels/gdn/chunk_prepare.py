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
This kernel computes those terms for every chunk independently (one program per (chunk, value
head), so the whole prefill fills the GPU), in one of two forms (`stacked`, see `chunk.py`):
- per-chunk WY: w, u, Aqk and qs = exp(gc) (times q's norm and scale);
- stacked: substituting delta into o moves Aqk out of the state pass altogether,
      o = Aqk @ u - (Aqk @ w - diag(qs) q) @ S_0 = ou - qw @ S_0,
  so the kernel also forms ou = Aqk @ u and qw = Aqk @ w - diag(qs) q and stacks the terms as
      wq = [w; qw]  [128, dk],   uo = [u; ou]  [128, dv]   ->   [delta; o] = uo - wq @ S_0,
  one 128-row dot per chunk in the state pass where there were three. Costs here: two more
  64x64x128 dots and 64 KiB instead of 40 KiB written per (chunk, head).
Results are stored per chunk slot (the chunk table's index) as whole 64-row tiles; rows past the
chunk's end are zero (their beta, q and k load as zero), so the state pass reads them unmasked.
`chunk_state.py` then carries the state across chunks.

The raw (un-normalised) q and k are what the dots consume: normalisation is a per-row scale, and it
is cheaper to scale the 64x64 results (or the small vectors) than the 64 x dk operands.

Launched with 4 warps (8 were much slower). Figures for this kernel alone: NOTES.md.

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
    block, a chain of 18 dots here; NOTES.md has the first version's time), while the single-level
    product (I - a)(I + a^2)(I + a^4)... loses all precision when keys are correlated (powers of a
    blow up; relative error 1e11 seen with emulated tf32).
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
    *out_refs,  # stacked: wq, uo, ks, gl; else w, u, aqk, qs, ks, gl
    scale, use_qk_l2norm, group, stacked,
):
    c = pl.program_id(0)
    h = pl.program_id(1)
    hk = h // group
    n = clen_ref[c]
    dk = q_ref.shape[-1]
    dv = v_ref.shape[-1]
    wq_ref, uo_ref, *rest, ks_ref, gl_ref = out_refs
    cd = wq_ref.dtype
    top = pl.ds(0, CHUNK)
    bottom = pl.ds(CHUNK, CHUNK)

    @pl.when(n > 0)
    def _():
        r0 = cstart_ref[c]
        rows = pl.ds(r0, CHUNK)
        idx = jnp.arange(CHUNK)
        live = idx < n
        i = idx[:, None]
        j = idx[None, :]
        causal = i >= j

        def load_qk(ref):
            return plt.load(ref.at[rows, hk, :], mask=row_mask(live, dk), other=0.0)

        def rnorm(x):
            return inv_norm(x.astype(jnp.float32)) if use_qk_l2norm else jnp.ones((CHUNK,), jnp.float32)

        def decay():
            # exp only where j <= i: there gc_i - gc_j <= 0 for g <= 0; elsewhere it could overflow.
            return jnp.where(causal, jnp.exp(jnp.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)

        k = load_qk(k_ref)
        g = plt.load(g_ref.at[rows, h], mask=live, other=0.0).astype(jnp.float32)
        beta = plt.load(beta_ref.at[rows, h], mask=live, other=0.0).astype(jnp.float32)
        rk = rnorm(k)
        k = k.astype(cd)
        gc = jnp.cumsum(g)  # dead rows add 0, so gc[63] is the last live row's
        g_last = jnp.sum(g)
        plt.store(ks_ref.at[h, c, :], rk * jnp.exp(g_last - gc))
        gl_ref[h, c] = g_last

        a = jnp.where(i > j, (beta * rk)[:, None] * dot(k, k, trans_b=True) * rk[None, :] * decay(), 0.0)
        t = unit_lower_inverse(a)

        # Only the inverse's own operands are live across it: v, k, q are read (again, from L2) and
        # Aqk formed after it, in this order (keeping them, or another order, spilled far more
        # registers to the stack; NOTES.md). Column scales of (I + A)^{-1} instead of row
        # scales of k / v: 64x64 instead of 64 x d.
        v = plt.load(v_ref.at[rows, h, :], mask=row_mask(live, dv), other=0.0).astype(cd)
        u = dot((t * beta[None, :]).astype(cd), v).astype(cd)
        uo_ref[h, c, top, :] = u
        k = load_qk(k_ref).astype(cd)
        w = dot((t * (beta * jnp.exp(gc) * rk)[None, :]).astype(cd), k).astype(cd)
        wq_ref[h, c, top, :] = w
        q = load_qk(q_ref)
        rq = rnorm(q) * scale
        aqk = (rq[:, None] * dot(q.astype(cd), k, trans_b=True) * rk[None, :] * decay()).astype(cd)
        qs = rq * jnp.exp(gc)
        if stacked:
            uo_ref[h, c, bottom, :] = dot(aqk, u).astype(cd)
            wq_ref[h, c, bottom, :] = (dot(aqk, w) - qs[:, None] * q.astype(jnp.float32)).astype(cd)
        else:
            aqk_ref, qs_ref = rest
            aqk_ref[h, c] = aqk
            plt.store(qs_ref.at[h, c, :], qs)


def chunk_prepare(q, k, v, g, beta, chunk_start, chunk_len, *, scale, use_qk_l2norm, mm_dtype, stacked=True,
                  num_warps=4, num_stages=1, interpret=False):
    """Per-chunk terms. chunk_start / chunk_len `[NC]`: first token and length (0 = unused) of every
    chunk slot. Returns, per value head and used chunk slot (unused slots are left unwritten), in
    mm_dtype unless said otherwise:
      stacked: wq = [w; qw] `[Hv, NC, 128, dk]`, uo = [u; ou] `[Hv, NC, 128, dv]`, ks, gl;
      else:    w `[Hv, NC, 64, dk]`, u `[Hv, NC, 64, dv]`, Aqk `[Hv, NC, 64, 64]`,
               qs `[Hv, NC, 64]` float32 = scale |q|^-1 exp(gc) (row scale of the raw q @ S), ks, gl;
    ks `[Hv, NC, 64]` float32 = |k|^-1 exp(gc_last - gc) (row scale of the raw k in the state
    update) and gl `[Hv, NC]` float32 = gc_last (the chunk's total log decay).
    """
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    num_slots = chunk_start.shape[0]
    kernel = functools.partial(_prepare_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               group=num_v_heads // num_k_heads, stacked=stacked)
    rows = 2 * CHUNK if stacked else CHUNK
    per_slot = lambda *shape, dtype=mm_dtype: jax.ShapeDtypeStruct((num_v_heads, num_slots) + shape, dtype)  # noqa: E731
    out_shape = (per_slot(rows, dk), per_slot(rows, dv))
    if not stacked:
        out_shape += (per_slot(CHUNK, CHUNK), per_slot(CHUNK, dtype=jnp.float32))
    out_shape += (per_slot(CHUNK, dtype=jnp.float32), per_slot(dtype=jnp.float32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_slots, num_v_heads),
        in_specs=[ANY] * 7,
        out_specs=[ANY] * len(out_shape),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_chunk_prepare",
    )(chunk_start, chunk_len, q, k, v, g, beta)
