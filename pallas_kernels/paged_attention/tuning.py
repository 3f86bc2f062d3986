"""Static launch shapes of the attention kernel, chosen from the (static) array shapes alone.

Everything here runs at trace time: T, B, Pmax, H, G, D and the page size L are fixed per bucket,
lengths are not, so a choice may only depend on the former. The numbers come from H200 runs of
`bench/kernels/paged_attention.py` (bench/results/kernels_paged_attention_h200.json).
"""

from __future__ import annotations

import dataclasses
import math

import jax


@dataclasses.dataclass(frozen=True)
class Config:
    """block_q: new tokens of one request per program (BQ); rows: BQ x H/G padded to a power of two
    (the MMA M dimension); block_kv: KV tokens per loop step; splits: programs along the KV axis
    (flash-decoding); pages_per_split: page-table entries each split covers."""

    block_q: int
    rows: int
    block_kv: int
    splits: int
    pages_per_split: int
    num_warps: int
    num_stages: int


def next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on H100 SXM and H200)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return 132
    return int(getattr(dev, "core_count", 132) or 132)


def choose(
    *,
    num_blocks: int,
    block_q: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    block_kv: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Config:
    """Fill in whatever the caller left as None.

    The KV step is 64 tokens (32 for D=256): a K and a V tile of 16 KiB each per pipeline stage.
    Steps of 32 to 256 tokens timed within 10% of each other for decode; 128 lost a third of the
    prefill rate (183 against 343 TFLOP/s).
    Splits: enough programs to give every SM a few (memory-bound decode needs many loads in
    flight), but never a split shorter than two KV steps. Decode at B=32, ctx=4096 timed 0.247,
    0.254 and 0.259 ms with 2, 4 and 8 splits: not a sensitive choice.
    """
    rows = next_pow2(max(16, block_q * group))
    if block_kv is None:
        block_kv = 32 if head_dim >= 256 else 64
    kv_tokens = pages_per_seq * page_size
    if splits is None:
        programs = max(1, num_blocks * num_kv_heads)
        want = max(1, math.ceil(4 * num_sms() / programs))
        most = max(1, kv_tokens // (2 * block_kv))
        splits = min(next_pow2(want), next_pow2(most) if most > 1 else 1)
        if rows >= 128:  # prefill-sized programs are plentiful and compute-bound
            splits = 1
    # A split covers whole KV steps, so split boundaries never cut a step.
    step_pages = max(1, block_kv // page_size)
    pages_per_split = math.ceil(math.ceil(pages_per_seq / splits) / step_pages) * step_pages
    splits = max(1, math.ceil(pages_per_seq / pages_per_split))
    if num_warps is None:
        # 4 warps up to a 128 x 128 tile: 8 warps cut 8k causal prefill from 343 to 286 TFLOP/s
        # and decode at B=32, ctx=4096 from 0.254 to 0.273 ms.
        num_warps = 4 if rows * head_dim <= 128 * 128 else 8
    if num_stages is None:
        # Decode (<= 16 rows) at B=32, ctx=4096: 4 stages 0.219-0.227 ms, 3 stages 0.254 ms, in
        # the same run (one program per SM then, yet faster: the page-id -> K/V chain needs the
        # depth). 8k causal prefill: 3 stages 343 TFLOP/s, 2 stages 336.
        num_stages = 4 if rows <= 16 else 3
    return Config(block_q, rows, block_kv, splits, pages_per_split, num_warps, num_stages)
