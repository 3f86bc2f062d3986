"""y = x @ w.T for few rows of x: a weight-streaming matmul for decode and small verify batches.

x `[M, K]`, w `[N, K]` (Hugging Face's `[out, in]`, as `jspec.models.layers.Linear` holds it), y
`[M, N]` in x's dtype, accumulated in float32. With M up to a few dozen rows the product reads each
weight once and does little arithmetic per byte, so the kernel's only job is to stream w at the
copy rate: one program per (split s of K, tile j of `block_n` rows of w). Each program walks its
rows of w in steps of `block_k` columns (every row of a step is `block_k` contiguous elements, and
`num_stages` steps are in flight), multiplies x's rows by them on the tensor cores (x padded to 16
rows inside the program: the smallest tensor-core tile), and stores a float32 partial `[S, M, N]`;
with one split it stores y's rows directly in x's dtype. Splits give the SMs enough programs when
N / block_n alone would leave them idle (o_proj: N 4096), without shortening the contiguous rows.

Lowering: Triton (compiler params select it on jax >= 0.11), so the same kernel runs in interpret
mode on the CPU; like the MoE kernels it indexes whole arrays in global memory (`pl.ANY`).

Not used by the engine: measured against XLA's matmuls it is no faster (NOTES.md), so it is kept as
the probe that can answer that question again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# The MoE kernels' launch-shape arithmetic and operand conventions, shared rather than copied.
from pallas_kernels.moe.gather_gemv import ANY, MMA_ROWS, block_for, num_sms


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shape. block_n: rows of w (output columns) per program; block_k: columns of w per
    loop step; splits: programs along K."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


def choose(n: int, k: int, *, block_n: int = 64, block_k: int = 128, programs_per_sm: int = 2,
           splits: int | None = None, num_warps: int = 4, num_stages: int = 4) -> Config:
    """A launch shape for w `[N, K]` from static shapes: the fewest splits (powers of two) that give
    every SM `programs_per_sm` programs, keeping at least two `block_k` steps per program."""
    block_n = block_for(n, block_n)
    if splits is None:
        splits, target = 1, programs_per_sm * num_sms()
        while (n // block_n) * splits < target and k % (2 * splits) == 0 and k // (2 * splits) >= 2 * block_k:
            splits *= 2
    if k % splits:
        raise ValueError(f"splits={splits} must divide K={k}")
    return Config(block_n, block_for(k // splits, block_k), splits, num_warps, num_stages)


def _kernel(x_ref, w_ref, o_ref, *, cfg: Config, rows: int, padded: int):
    s, j = pl.program_id(0), pl.program_id(1)
    chunk = w_ref.shape[1] // cfg.splits
    bn, bk = cfg.block_n, cfg.block_k
    dtype = w_ref.dtype
    r = jnp.arange(padded, dtype=jnp.int32)[:, None]
    live = r < rows
    # Padding rows index one past the last row: their loads and stores are masked on the GPU, and
    # interpret mode drops out-of-range stores.
    row = jnp.where(live, r, rows)
    k_mask = jnp.broadcast_to(live, (padded, bk))
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

    def step(i, acc):
        k0 = s * chunk + i * bk
        kk = k0 + jnp.arange(bk, dtype=jnp.int32)[None, :]
        a = plt.load(x_ref.at[row, kk], mask=k_mask, other=0.0).astype(dtype)
        w = w_ref[pl.ds(j * bn, bn), pl.ds(k0, bk)]
        return acc + jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, chunk // bk, step, jnp.zeros((padded, bn), jnp.float32))
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)[None, :]
    out_mask = jnp.broadcast_to(live, (padded, bn))
    if cfg.splits == 1:
        plt.store(o_ref.at[row, cols], acc.astype(o_ref.dtype), mask=out_mask)
    else:
        plt.store(o_ref.at[s, row, cols], acc, mask=out_mask)


def skinny_matmul(x, w, *, cfg: Config | None = None, interpret: bool = False):
    """y `[M, N]` = x `[M, K]` @ w `[N, K]`.T in x's dtype (float32 accumulation)."""
    m, k = x.shape
    n, k_w = w.shape
    if k != k_w:
        raise ValueError(f"x has K={k} columns, w has {k_w}")
    cfg = cfg or choose(n, k)
    if k % (cfg.splits * cfg.block_k) or n % cfg.block_n:
        raise ValueError(f"{cfg} does not tile a [{n}, {k}] weight")
    padded = max(MMA_ROWS, 1 << (m - 1).bit_length())
    shape = (m, n) if cfg.splits == 1 else (cfg.splits, m, n)
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, rows=m, padded=padded),
        grid=(cfg.splits, n // cfg.block_n),
        in_specs=[ANY, ANY],
        out_specs=ANY,
        out_shape=jax.ShapeDtypeStruct(shape, x.dtype if cfg.splits == 1 else jnp.float32),
        interpret=interpret,
        name="skinny_matmul",
        **params,
    )(x, w)
    return out if cfg.splits == 1 else out.sum(0).astype(x.dtype)
