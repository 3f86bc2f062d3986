"""Chunked prefill of the gated delta rule over ragged sequences (chunk size 64).

Two Pallas kernels: `chunk_prepare` (every chunk in parallel: the WY terms) and `chunk_state` (one
program per request, value head and dv block: the state pass and the output). Chunks start at each
request's first token, so a request's last chunk may be partial; the chunk table that maps chunk
slots to (first token, length) is a few tiny XLA ops on `[T // 64 + B]` integers. The terms are
stored per chunk slot in whole 64-row tiles, so the state pass reads them without masks.

Two forms of the terms (ChunkConfig.stacked; the default picks by the static batch size):
- per-chunk WY (w, u, Aqk): 4 dots per chunk in the state pass, fewest bytes; for many requests,
  where the state pass fills the GPU and moves a lot of data;
- stacked ([w; Aqk w - qs q], [u; Aqk u]): Aqk folded into the terms by the parallel kernel (two
  more dots there, 1.6x the bytes), 2 dots per chunk in the state pass; for few requests, where
  the state pass is one sequential chain per (head, dv block) and its length is the time.
At one 8192-token prompt the stacked form wins, at 8 x 2048 the per-chunk form; with the right form
the whole prefill is as fast as flash-linear-attention's chunk kernel or faster (bench/kernels/gdn.py;
figures in NOTES.md).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.gdn.chunk_prepare import chunk_prepare
from pallas_kernels.gdn.chunk_state import chunk_state
from pallas_kernels.gdn.common import CHUNK, block_for, matmul_dtype


# Multiprocessors of the Hopper GPUs the kernels are tuned for: below this many state-pass programs
# the GPU is not full.
NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Launch parameters; the defaults are the ones measured best in bench/kernels/gdn.py (NOTES.md).

    `stacked` (None: from the static batch size) picks the form of the chunk terms, `block_v` (0:
    likewise) the state pass's dv block. Few requests (B * Hv * dv / 64 state programs would leave
    multiprocessors idle, e.g. one long prompt): the state pass is a latency chain, so the stacked
    form (2 dots per chunk) and dv blocks of 32. Many: the per-chunk WY form, which moves fewer
    bytes and costs the parallel kernel two dots less, and dv blocks of 64. The state pass takes 3
    pipeline stages (2 were much slower, 4 a little) and 4 warps (8 were slower everywhere).
    The switch point (programs < multiprocessors) sits between the two measured shapes (1 x 8192 and
    8 x 2048 tokens); batches 2 to 7 were not timed.
    """

    block_v: int = 0
    stacked: bool | None = None
    state_warps: int = 4
    state_stages: int = 3
    prepare_warps: int = 4
    prepare_stages: int = 1

    @staticmethod
    def few_requests(batch: int, num_v_heads: int, dv: int) -> bool:
        return batch * num_v_heads * max(dv // 64, 1) < NUM_SMS

    def use_stacked(self, batch: int, num_v_heads: int, dv: int) -> bool:
        return self.few_requests(batch, num_v_heads, dv) if self.stacked is None else self.stacked

    def state_block_v(self, batch: int, num_v_heads: int, dv: int) -> int:
        want = self.block_v or (32 if self.few_requests(batch, num_v_heads, dv) else 64)
        return block_for(dv, want)


DEFAULT_CONFIG = ChunkConfig()


def chunk_table(cu_seqlens, num_tokens: int):
    """(first token, length) of every chunk slot `[T // 64 + B]`; unused slots get length 0.

    A request of length L owns ceil(L / 64) consecutive slots; sum over requests of ceil(L_b / 64)
    <= T // 64 + B, so the static slot count always suffices.
    """
    batch = cu_seqlens.shape[0] - 1
    num_slots = num_tokens // CHUNK + batch
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = (lens + CHUNK - 1) // CHUNK
    ends = jnp.cumsum(counts)
    c = jnp.arange(num_slots, dtype=jnp.int32)
    # A compare-and-count is one small fusion on the GPU; searchsorted's default is a loop of launches.
    req = jnp.sum(ends[None, :] <= c[:, None], axis=1, dtype=jnp.int32)
    req_c = jnp.minimum(req, batch - 1)
    within = c - (ends[req_c] - counts[req_c])
    start = cu_seqlens[req_c] + within * CHUNK
    length = jnp.where(req < batch, jnp.minimum(CHUNK, lens[req_c] - within * CHUNK), 0)
    return start.astype(jnp.int32), length.astype(jnp.int32)


def first_chunk_slot(cu_seqlens):
    """Index of each request's first chunk slot `[B]` (its chunks follow in consecutive slots)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = (lens + CHUNK - 1) // CHUNK
    return (jnp.cumsum(counts) - counts).astype(jnp.int32)


def gated_delta_rule(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial, *, scale=None,
                     use_qk_l2norm=True, interpret=False, config: ChunkConfig | None = None, save_rows=None):
    """Pallas version of `reference.gated_delta_rule` (same arguments and results). save_rows are
    taken at the last token of each 64-token chunk of a request (and its last token) only: a row
    named elsewhere is not written."""
    cfg = config or DEFAULT_CONFIG
    num_tokens, _, dk = q.shape
    dv = v.shape[-1]
    if scale is None:
        scale = dk ** -0.5
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    start, length = chunk_table(cu_seqlens, num_tokens)
    batch = slots.shape[0]
    num_v_heads = v.shape[1]
    mm = matmul_dtype(q.dtype)
    terms = chunk_prepare(
        q, k, v, g, beta, start, length, scale=float(scale), use_qk_l2norm=use_qk_l2norm, mm_dtype=mm,
        stacked=cfg.use_stacked(batch, num_v_heads, dv), num_warps=cfg.prepare_warps,
        num_stages=cfg.prepare_stages, interpret=interpret)
    chunk_saves = None
    if save_rows is not None:  # each chunk slot's row: the one named at its last token
        last = jnp.clip(start + length - 1, 0, num_tokens - 1)
        chunk_saves = jnp.where(length > 0, save_rows.astype(jnp.int32)[last], -1)
    return chunk_state(
        q.astype(mm), k.astype(mm), terms, state_pool, cu_seqlens, first_chunk_slot(cu_seqlens),
        slots.astype(jnp.int32), has_initial, block_v=cfg.state_block_v(batch, num_v_heads, dv),
        out_dtype=q.dtype, num_warps=cfg.state_warps, num_stages=cfg.state_stages, interpret=interpret,
        chunk_saves=chunk_saves)
