"""Routed experts for decode / verify batches: two expert-tiled gathered-GEMM kernels.

For P = T*K (token, expert) pairs, with e = experts[t, k] and p = t*K + k:
    up:    gu[p]  = x[t] @ gate_up[e]                          gate_up [X, E, 2I]
    down:  y[p]   = (silu(gu[p, :I]) * gu[p, I:]) @ down[e]    down    [X, I, E]
    out[t] = sum_k weights[t, k] * y[t*K + k]                  (jnp, float32)

Pairs are grouped into tiles of up to M = `block_m` pairs of one expert (`tiles.py`), so a program
reads its expert's weights once for all the pairs of its tile. Both kernels are the same loop. One
program = (tile, split s of the contracted axis, tile j of `block_n` output columns): it gathers the
rows of its pairs into an `[M, block_k]` operand (padding rows zero), multiplies it on the tensor
cores by rows [s*chunk, (s+1)*chunk) of columns j of its expert's matrix in steps of `block_k` rows
(each row `block_n` contiguous elements, staged through shared memory with `num_stages` loads in
flight), and stores each live row into a float32 partial sum `[S, P, N]` (masked: one row per
pair). Unused tiles return at once. Splitting the contracted axis gives every SM several programs
when there are few tiles (batch 1: 10 tiles) without shortening the contiguous rows. The down
kernel's prologue sums the up kernel's partials of its pairs and applies silu(gate) * up on the fly,
so h never makes a round trip of its own; the last jnp fusion sums the down partials and weights
the K experts of each token.

With one pair per tile (`tiles.pair_tiles`: one token, or too few pairs per expert for repeats to
matter, see `sorts`) this runs the schedule of the per-pair kernel it replaced: one program per
(pair, split, column tile), the pair's input loaded as one vector into row 0 of a 16-row operand,
the same weight reads (the generic masked 16-row gather, `single_row=False`, is about twice as slow
at one token). With sorted tiles an expert shared by n pairs is read ceil(n / M) times instead of n
times.

Rounding follows `reference.moe_gather`: the gate_up product, silu(gate) * up and the down product
are rounded to the activation dtype, as the XLA path rounds them. Rows of a tile never mix (a row of
a matrix product depends only on its own row of the operand), so each pair's result is rounded
exactly as when it was alone; against a float32 oracle the kernels err no more than XLA does.

Against XLA's grouped GEMM (`ragged_dot`) the tiled kernels win at every measured size but the
smallest Qwen3-30B-A3B ones, by a margin that grows with T, because `ragged_dot` computes far more
than the routed rows (bench/kernels/moe.py; figures in NOTES.md).

Lowering: Triton (compiler params select it on jax >= 0.11), so the same kernel runs in interpret
mode on the CPU. No Mosaic GPU variant was written: where the expert weights dominate (large T) this
kernel already streams them close to the copy rate, which leaves a TMA kernel little to win. At
T = 1 (further from it) the likely cost is each program's short dependent chain (tile -> expert ->
rows); that was not compared against a Mosaic GPU variant. Every operand is a whole array in global
memory and indexed by the kernel, because the expert of a program is data (`tile_expert[tile]`), not
a block index. Measured figures behind all of this: NOTES.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.moe import tiles

ANY = pl.BlockSpec(memory_space=pl.ANY)
MMA_ROWS = 16  # the smallest tensor-core tile height: a tile of 16 pairs costs what one pair did
# Pairs per expert (T*K / X) from which tiles are planned by sorting pairs by expert. Below it the
# plan is one pair per tile, which needs no device work and loads each pair's input as one vector.
# Timed against each other, the sort (its own small XLA kernels included) pays from above one pair
# per expert (figures in NOTES.md).
SORT_MIN_LOAD = 1.25


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shape of one gathered-GEMM kernel. block_n: output columns per program; block_k:
    contracted rows per loop step; splits: programs along the contracted axis."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


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


# Launch-shape defaults per kernel, from bench/kernels/moe.py runs on the per-pair kernel (each
# kernel timed alone at Qwen3-Next T=1 and T=4, then the whole op over both shapes and T in
# {1, 4, 8, 16}); not yet re-tuned for tiles of several pairs. The padded tensor-core dot beat
# float32 multiply-adds in both kernels, so the multiply-add variant was dropped when tiles made the
# operand M rows tall. Programs per SM, block_k and warps are not sensitive choices; a single split
# (one program per output tile) is clearly slower at T=1. Figures in NOTES.md.
DEFAULTS = {
    "up": dict(block_n=256, block_k=64, programs_per_sm=2, num_warps=4, num_stages=3),
    "down": dict(block_n=128, block_k=64, programs_per_sm=2, num_warps=4, num_stages=3),
    # Down over sorted tiles (wide decode / verify batches): each column tile's program gathers and
    # re-forms its pairs' silu(gate) * up rows, so wider column tiles form them fewer times; a short
    # contracted axis (I) then streams best in shorter steps (bench/kernels/moe_shapes_probe.py).
    "down_sorted": dict(block_n=512, block_k=32, programs_per_sm=2, num_warps=4, num_stages=3),
}


def choose(num_tiles: int, k_dim: int, n_dim: int, *, mode: str = "up", block_n=None, block_k=None, splits=None,
           num_warps=None, num_stages=None, programs_per_sm=None) -> Config:
    """Fill in whatever the caller left as None from `DEFAULTS[mode]` (mode: a key of DEFAULTS, the
    kernel's mode or "down_sorted" for a down kernel over sorted tiles), from static shapes only.

    num_tiles: the plan's tile count NT (its static bound, used or not). Splits: the fewest that
    give every SM `programs_per_sm` programs (a memory-bound stream needs several programs' loads in
    flight per SM), keeping at least two `block_k` steps per program.
    """
    d = DEFAULTS[mode]
    block_n = block_for(n_dim, block_n or d["block_n"])
    want_k = block_k or d["block_k"]
    if splits is None:
        programs = num_tiles * (n_dim // block_n)
        target = (programs_per_sm or d["programs_per_sm"]) * num_sms()
        splits = 1
        while programs * splits < target and k_dim % (2 * splits) == 0 and k_dim // (2 * splits) >= 2 * want_k:
            splits *= 2
    if k_dim % splits:
        raise ValueError(f"splits={splits} must divide the contracted size {k_dim}")
    block_k = block_for(k_dim // splits, want_k)
    return Config(block_n, block_k, splits, num_warps or d["num_warps"], num_stages or d["num_stages"])


def _kernel(tile_expert_ref, tile_pairs_ref, src_ref, w_ref, o_ref, *, mode: str, cfg: Config, top_k: int,
            inter: int, exact_f32: bool, single: bool):
    tile, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = tile_expert_ref[tile]

    @pl.when(e >= 0)
    def _():
        block_m = tile_pairs_ref.shape[1]
        block_k, block_n = cfg.block_k, cfg.block_n
        chunk = w_ref.shape[1] // cfg.splits
        dtype = w_ref.dtype
        if single:
            _single_pair(tile, e, s, j, src_ref, w_ref, o_ref, mode=mode, cfg=cfg, top_k=top_k, inter=inter,
                         exact_f32=exact_f32, block_m=block_m, chunk=chunk)
            return
        pairs = tile_pairs_ref[tile, pl.ds(0, block_m)]
        live = pairs >= 0
        # Padding rows index one past the last pair: their loads and stores are masked on the GPU,
        # and interpret mode drops out-of-range stores (a -1 would wrap to the last pair there).
        pair = jnp.where(live, pairs, o_ref.shape[1])[:, None]
        row = pair // top_k if mode == "up" else pair
        k_mask = jnp.broadcast_to(live[:, None], (block_m, block_k))  # constant along rows: wide loads

        def operand(k0):  # [M, BK]: this tile's rows of the input, in the weights' dtype
            kk = k0 + jnp.arange(block_k, dtype=jnp.int32)[None, :]

            if mode == "up":
                return plt.load(src_ref.at[row, kk], mask=k_mask, other=0.0).astype(dtype)
            # Down: sum the up kernel's partials for these rows of gate and up, then silu(gate) * up,
            # each rounded where the reference rounds. (One indexer per load: Triton's lowering
            # takes no chained `.at`.)
            parts = range(src_ref.shape[0])
            gate = sum(plt.load(src_ref.at[i, row, kk], mask=k_mask, other=0.0) for i in parts)
            up = sum(plt.load(src_ref.at[i, row, inter + kk], mask=k_mask, other=0.0) for i in parts)
            gate = gate.astype(dtype).astype(jnp.float32)
            up = up.astype(dtype).astype(jnp.float32)
            return (gate / (1.0 + jnp.exp(-gate)) * up).astype(dtype)

        precision = jax.lax.Precision.HIGHEST if exact_f32 else None

        def step(i, acc):
            k0 = s * chunk + i * block_k
            w = w_ref[e, pl.ds(k0, block_k), pl.ds(j * block_n, block_n)]
            return acc + jax.lax.dot_general(operand(k0), w, (((1,), (0,)), ((), ())), precision=precision,
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, chunk // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
        cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
        plt.store(o_ref.at[s, pair, cols], acc, mask=jnp.broadcast_to(live[:, None], (block_m, block_n)))


def _single_pair(p, e, s, j, src_ref, w_ref, o_ref, *, mode, cfg, top_k, inter, exact_f32, block_m, chunk):
    """A one-pair-per-tile plan (tile p = pair p): load the pair's input as one [BK] vector and put
    it in row 0 of the MMA operand, instead of a masked 16-row gather whose 15 dead rows still cost
    address arithmetic and load instructions in every step. Same products, same rounding."""
    block_k, block_n = cfg.block_k, cfg.block_n
    dtype = w_ref.dtype
    first_row = (jnp.arange(block_m, dtype=jnp.int32) == 0)[:, None]
    precision = jax.lax.Precision.HIGHEST if exact_f32 else None

    def vector(k0):
        rows = pl.ds(k0, block_k)
        if mode == "up":
            return src_ref[p // top_k, rows].astype(dtype)
        gate = sum(src_ref[i, p, rows] for i in range(src_ref.shape[0]))
        up = sum(src_ref[i, p, pl.ds(inter + k0, block_k)] for i in range(src_ref.shape[0]))
        gate = gate.astype(dtype).astype(jnp.float32)
        up = up.astype(dtype).astype(jnp.float32)
        return (gate / (1.0 + jnp.exp(-gate)) * up).astype(dtype)

    def step(i, acc):
        k0 = s * chunk + i * block_k
        a = jnp.where(first_row, jnp.broadcast_to(vector(k0)[None, :], (block_m, block_k)), jnp.zeros((), dtype))
        w = w_ref[e, pl.ds(k0, block_k), pl.ds(j * block_n, block_n)]
        return acc + jax.lax.dot_general(a, w, (((1,), (0,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, chunk // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[s, p, pl.ds(j * block_n, block_n)] = jnp.sum(acc, axis=0)  # rows 1.. are zeros


def gathered_gemv(tile_expert, tile_pairs, src, w, *, mode: str, cfg: Config, top_k: int,
                  interpret: bool = False, single: bool = False):
    """Partial sums `[S, P, N]` float32 of each pair's vector times its expert's `w[e]` `[Kd, N]`,
    over the tiles of a plan (`tiles.py`).

    mode "up": src is x `[T, E]`, pair p reads row p // top_k. mode "down": src is the up kernel's
    partials `[S', P, 2I]`, from which the kernel forms silu(gate) * up. single: the plan is one pair
    per tile in pair order (`tiles.pair_tiles`), so tile p serves pair p alone."""
    pairs = src.shape[0] * top_k if mode == "up" else src.shape[1]
    num_tiles, block_m = tile_pairs.shape
    _, k_dim, n_dim = w.shape
    if k_dim % (cfg.splits * cfg.block_k) or n_dim % cfg.block_n:
        raise ValueError(f"{cfg} does not tile a [{k_dim}, {n_dim}] expert matrix")
    if not interpret and (block_m < MMA_ROWS or block_m & (block_m - 1)):
        raise ValueError(f"block_m={block_m}: Triton's dot wants a power of two >= {MMA_ROWS}")
    kernel = functools.partial(_kernel, mode=mode, cfg=cfg, top_k=top_k, inter=k_dim if mode == "down" else 0,
                               exact_f32=jnp.dtype(w.dtype) == jnp.float32, single=single)
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, cfg.splits, n_dim // cfg.block_n),
        in_specs=[ANY] * 4,
        out_specs=ANY,
        out_shape=jax.ShapeDtypeStruct((cfg.splits, pairs, n_dim), jnp.float32),
        interpret=interpret,
        name=f"moe_gather_{mode}",
        **params,
    )(tile_expert, tile_pairs, src, w)


def sorts(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the default plan sorts: from SORT_MIN_LOAD pairs per expert on, and never for one
    token (whose top-k experts are distinct, so sorting finds nothing to share)."""
    return tokens > 1 and tokens * top_k >= SORT_MIN_LOAD * num_experts


def plan(experts, num_experts: int, *, block_m: int = MMA_ROWS, sort: bool | None = None):
    """The tile plan of `experts` `[T, K]`: sorted by expert when `sort` (None: `sorts`) says so,
    else one pair per tile."""
    if sort is None:
        sort = sorts(*experts.shape, num_experts)
    flat = experts.reshape(-1).astype(jnp.int32)
    return tiles.sorted_tiles(flat, num_experts, block_m) if sort else tiles.pair_tiles(flat, block_m)


def moe_gather_pallas(x, experts, weights, gate_up, down, *, block_m: int = MMA_ROWS, sort: bool | None = None,
                      up_cfg: Config | None = None, down_cfg: Config | None = None, interpret: bool = False,
                      single_row: bool = True):
    """Same contract as `reference.moe_gather`. block_m: pairs per tile; sort: the plan (None:
    `sorts`); up_cfg / down_cfg: launch shapes (None: `choose` for the plan's tile count);
    single_row: with one pair per tile, load each pair's input as one vector (False: the generic
    masked row gather, kept for measuring the two against each other)."""
    t, e = x.shape
    k = experts.shape[1]
    inter = down.shape[1]
    if sort is None:
        sort = sorts(t, k, gate_up.shape[0])
    tile_expert, tile_pairs = plan(experts, gate_up.shape[0], block_m=block_m, sort=sort)
    num_tiles = tile_expert.shape[0]
    single = not sort and single_row
    up_cfg = up_cfg or choose(num_tiles, e, 2 * inter, mode="up")
    down_cfg = down_cfg or choose(num_tiles, inter, e, mode="down_sorted" if sort else "down")
    gu = gathered_gemv(tile_expert, tile_pairs, x, gate_up, mode="up", cfg=up_cfg, top_k=k, interpret=interpret,
                       single=single)
    y = gathered_gemv(tile_expert, tile_pairs, gu, down, mode="down", cfg=down_cfg, top_k=k, interpret=interpret,
                      single=single)
    y = jnp.sum(y, axis=0).astype(x.dtype).reshape(t, k, e).astype(jnp.float32)
    return jnp.sum(y * weights[:, :, None].astype(jnp.float32), axis=1).astype(x.dtype)


def supported(x, gate_up, down) -> bool:
    """Shapes the kernels tile: hidden and intermediate sizes multiples of 16. Stacks of any size:
    the Triton lowering addresses a ref past 2**32 bytes with 64-bit offsets (Qwen3.5-397B's
    gate_up holds 2**32 bf16 elements; `bench/kernels/moe_large_stack_probe.py` checks it on a GPU)."""
    return x.shape[1] % 16 == 0 and down.shape[1] % 16 == 0 and math.prod(x.shape) > 0
