"""Routed experts for few tokens: two gathered-GEMV kernels that stream each pair's expert once.

For P = T*K (token, expert) pairs, with e = experts[t, k]:
    up:    gu[p]  = x[t] @ gate_up[e]                          gate_up [X, E, 2I]
    down:  y[p]   = (silu(gu[p, :I]) * gu[p, I:]) @ down[e]    down    [X, I, E]
    out[t] = sum_k weights[t, k] * y[t*K + k]                  (jnp, float32)

Both kernels are the same loop. One program = (pair p, split s of the contracted axis, tile j of
`block_n` output columns): it reads rows [s*chunk, (s+1)*chunk) of columns j of its expert's matrix
in steps of `block_k` rows (each row `block_n` contiguous elements) and writes a float32 partial
sum `[S, P, N]`. Splitting the contracted axis gives every SM several programs at batch 1 (P=10)
without shortening the contiguous rows. The down kernel's prologue sums the up kernel's partials
for the rows it contracts and applies silu(gate) * up on the fly, so h never makes a round trip of
its own; the last jnp fusion sums the down partials and weights the K experts of each token.

Products: `mma=False` multiplies in float32 registers and reduces over rows once at the end;
`mma=True` puts the vector in row 0 of a 16-row operand (zeros elsewhere) and uses a tensor-core
dot, whose operands Triton stages through shared memory with `num_stages` loads in flight.

Rounding follows `reference.moe_gather`: the gate_up product, silu(gate) * up and the down product
are rounded to the activation dtype, as the XLA path rounds them. On the H200 (bf16) the result is
0.007 (relative L2) from XLA's and 0.004 from a float32 oracle, against XLA's own 0.006.

Measured (H200, jax 0.11.2, bf16, bench/kernels/moe.py; rotated random routing, weights far above
L2): Qwen3-Next shapes (X=512, K=10, E=2048, I=512) T=1 28.5 us against XLA's gather fusion 123 us
(0.64 vs 0.15 of the rate of a device copy of the same 63 MB, which itself takes 36 us); T=4
72.6 vs 481 us (0.83 vs 0.13). Qwen3-30B-A3B shapes T=1 34.3 vs 150 us, T=4 78.6 vs 543 us. At T=1
each kernel pays a few microseconds of launch and pipeline fill (up 18 us for 42 MB, down 11 us
for 21 MB). From T=8 on the rate counted per pair passes the copy's, because experts repeated
across tokens are then served from L2.

Lowering: Triton (compiler params select it on jax >= 0.11), so the same kernel runs in interpret
mode on the CPU. Every operand is a whole array in global memory and indexed by the kernel,
because the expert of a program is data (`experts[p]`), not a block index.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

ANY = pl.BlockSpec(memory_space=pl.ANY)
MMA_ROWS = 16  # the smallest tensor-core tile height


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shape of one gathered-GEMV kernel. block_n: output columns per program; block_k:
    contracted rows per loop step; splits: programs along the contracted axis; mma: tensor-core dot
    on a padded operand instead of float32 multiply-adds."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int
    mma: bool


def num_sms() -> int:
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return 132
    return int(getattr(dev, "core_count", 132) or 132)


def block_for(dim: int, want: int) -> int:
    """Largest power of two <= want that divides dim."""
    b = 1
    while b * 2 <= want and dim % (b * 2) == 0:
        b *= 2
    return b


# Launch-shape defaults per kernel, from H200 runs of bench/kernels/moe.py (each kernel timed alone
# at Qwen3-Next T=1 and T=4, then the whole op over both shapes and T in {1, 4, 8, 16}).
# down: the padded dot wins clearly (12.4 vs 16.0 us at T=1 for the best float32 multiply-add
# shape): its loads go through Triton's pipelined shared-memory staging. up: the padded dot with
# 256-column tiles against float32 multiply-adds with 128-column tiles, 32-row steps, 8 warps, for
# the whole op: the dot was faster in all 8 table rows of the last run (Qwen3-Next T=1 28.5 vs
# 29.3 us, T=4 72.6 vs 75.9 us) and in 7 of 8 of the run before (T=1 28.0 vs 27.2 us: noise).
# 2-8 programs per SM, block_k 32-64 and 2-8 warps timed within ~15% of each other; a single split
# (one program per output tile) was 30-50% slower at T=1.
DEFAULTS = {
    "up": dict(block_n=256, block_k=64, programs_per_sm=2, num_warps=4, num_stages=3, mma=True),
    "down": dict(block_n=128, block_k=64, programs_per_sm=2, num_warps=4, num_stages=3, mma=True),
}


def choose(pairs: int, k_dim: int, n_dim: int, *, mode: str = "up", block_n=None, block_k=None, splits=None,
           num_warps=None, num_stages=None, mma=None, programs_per_sm=None) -> Config:
    """Fill in whatever the caller left as None from `DEFAULTS[mode]`, from static shapes only.

    Splits: the fewest that give every SM `programs_per_sm` programs (a memory-bound stream needs
    several programs' loads in flight per SM), keeping at least two `block_k` steps per program.
    """
    d = DEFAULTS[mode]
    block_n = block_for(n_dim, block_n or d["block_n"])
    want_k = block_k or d["block_k"]
    if splits is None:
        tiles = pairs * (n_dim // block_n)
        target = (programs_per_sm or d["programs_per_sm"]) * num_sms()
        splits = 1
        while tiles * splits < target and k_dim % (2 * splits) == 0 and k_dim // (2 * splits) >= 2 * want_k:
            splits *= 2
    if k_dim % splits:
        raise ValueError(f"splits={splits} must divide the contracted size {k_dim}")
    block_k = block_for(k_dim // splits, want_k)
    return Config(block_n, block_k, splits, num_warps or d["num_warps"], num_stages or d["num_stages"],
                  d["mma"] if mma is None else bool(mma))


def _kernel(experts_ref, src_ref, w_ref, o_ref, *, mode: str, cfg: Config, top_k: int, inter: int, exact_f32: bool):
    p, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = experts_ref[p]
    block_k, block_n = cfg.block_k, cfg.block_n
    chunk = w_ref.shape[1] // cfg.splits
    cols = pl.ds(j * block_n, block_n)
    dtype = w_ref.dtype

    def vector(k0):  # the [BK] slice of this pair's input vector, in the weights' dtype
        rows = pl.ds(k0, block_k)
        if mode == "up":
            return src_ref[p // top_k, rows].astype(dtype)
        # Down: sum the up kernel's partials for these rows of gate and up, then silu(gate) * up,
        # each rounded where the reference rounds.
        gate = sum(src_ref[i, p, rows] for i in range(src_ref.shape[0]))
        up = sum(src_ref[i, p, pl.ds(inter + k0, block_k)] for i in range(src_ref.shape[0]))
        gate = gate.astype(dtype).astype(jnp.float32)
        up = up.astype(dtype).astype(jnp.float32)
        return (gate / (1.0 + jnp.exp(-gate)) * up).astype(dtype)

    if cfg.mma:
        first_row = (jnp.arange(MMA_ROWS, dtype=jnp.int32) == 0)[:, None]
        precision = jax.lax.Precision.HIGHEST if exact_f32 else None

        def step(i, acc):
            k0 = s * chunk + i * block_k
            v = vector(k0)
            a = jnp.where(first_row, jnp.broadcast_to(v[None, :], (MMA_ROWS, block_k)), jnp.zeros((), dtype))
            w = w_ref[e, pl.ds(k0, block_k), cols]
            return acc + jax.lax.dot_general(a, w, (((1,), (0,)), ((), ())), precision=precision,
                                             preferred_element_type=jnp.float32)

        acc = jnp.zeros((MMA_ROWS, block_n), jnp.float32)
    else:

        def step(i, acc):
            k0 = s * chunk + i * block_k
            v = vector(k0).astype(jnp.float32)
            w = w_ref[e, pl.ds(k0, block_k), cols].astype(jnp.float32)
            return acc + v[:, None] * w

        acc = jnp.zeros((block_k, block_n), jnp.float32)
    acc = jax.lax.fori_loop(0, chunk // block_k, step, acc)
    o_ref[s, p, cols] = jnp.sum(acc, axis=0)  # rows 1.. of the mma accumulator are zeros


def gathered_gemv(experts, src, w, *, mode: str, cfg: Config, top_k: int, interpret: bool = False):
    """Partial sums `[S, P, N]` float32 of each pair's vector times its expert's `w[e]` `[Kd, N]`.

    mode "up": src is x `[T, E]`, pair p reads row p // top_k. mode "down": src is the up kernel's
    partials `[S', P, 2I]`, from which the kernel forms silu(gate) * up."""
    pairs = experts.shape[0]
    _, k_dim, n_dim = w.shape
    if k_dim % (cfg.splits * cfg.block_k) or n_dim % cfg.block_n:
        raise ValueError(f"{cfg} does not tile a [{k_dim}, {n_dim}] expert matrix")
    kernel = functools.partial(_kernel, mode=mode, cfg=cfg, top_k=top_k, inter=k_dim if mode == "down" else 0,
                               exact_f32=jnp.dtype(w.dtype) == jnp.float32)
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pl.pallas_call(
        kernel,
        grid=(pairs, cfg.splits, n_dim // cfg.block_n),
        in_specs=[ANY] * 3,
        out_specs=ANY,
        out_shape=jax.ShapeDtypeStruct((cfg.splits, pairs, n_dim), jnp.float32),
        interpret=interpret,
        name=f"moe_gather_{mode}",
        **params,
    )(experts, src, w)


def moe_gather_pallas(x, experts, weights, gate_up, down, *, up_cfg: Config | None = None,
                      down_cfg: Config | None = None, interpret: bool = False):
    """Same contract as `reference.moe_gather`."""
    t, e = x.shape
    k = experts.shape[1]
    pairs = t * k
    inter = down.shape[1]
    up_cfg = up_cfg or choose(pairs, e, 2 * inter, mode="up")
    down_cfg = down_cfg or choose(pairs, inter, e, mode="down")
    flat = experts.reshape(-1).astype(jnp.int32)
    gu = gathered_gemv(flat, x, gate_up, mode="up", cfg=up_cfg, top_k=k, interpret=interpret)
    y = gathered_gemv(flat, gu, down, mode="down", cfg=down_cfg, top_k=k, interpret=interpret)
    y = jnp.sum(y, axis=0).astype(x.dtype).reshape(t, k, e).astype(jnp.float32)
    return jnp.sum(y * weights[:, :, None].astype(jnp.float32), axis=1).astype(x.dtype)


def supported(x, gate_up, down) -> bool:
    """Shapes the kernels tile: hidden and intermediate sizes multiples of 16, and expert stacks
    that 32-bit element offsets can address (the Triton lowering indexes in int32)."""
    return (x.shape[1] % 16 == 0 and down.shape[1] % 16 == 0 and math.prod(x.shape) > 0
            and max(gate_up.size, down.size) < 2**31)
