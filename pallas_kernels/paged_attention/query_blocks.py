"""Ragged tokens -> a fixed-size list of query blocks, and the way back.

A kernel program owns `BQ` consecutive new tokens of one request (a "query block"). Request `b`
needs `ceil(q_len[b] / BQ)` blocks, so a step never needs more than
`NB = min(T, ceil(T / BQ) + B)` of them: that bound is static, the actual count is not. Blocks
past the actual count get request index `B` and do nothing.

Keeping blocks inside one request (instead of cutting the flat token axis every BQ tokens) lets a
program load one page-table row and one KV length, which is what makes it cheap.
"""

from __future__ import annotations

import jax.numpy as jnp



def request_of(ends, idx):
    """Index of the first inclusive end above `idx`: which request (or block range) owns idx.

    "scan_unrolled" keeps the binary search free of an XLA while loop, whose trip test would
    otherwise round-trip to the host on GPU.
    """
    return jnp.searchsorted(ends, idx, side="right", method="scan_unrolled").astype(jnp.int32)


def max_blocks(num_tokens: int, batch: int, block_q: int) -> int:
    return max(1, min(num_tokens, -(-num_tokens // block_q) + batch))


def plan(cu_q_lens, num_blocks: int, block_q: int):
    """Per query block: its request `[NB]` (B when unused) and its first new-token index `[NB]`."""
    batch = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    blocks_per_req = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks_per_req).astype(jnp.int32)  # inclusive
    i = jnp.arange(num_blocks, dtype=jnp.int32)
    req = request_of(ends, i)  # B past the last block
    first = (ends - blocks_per_req)[jnp.minimum(req, batch - 1)]
    q_start = (i - first) * block_q
    return req, jnp.where(req < batch, q_start, 0).astype(jnp.int32)


def gather_rows(out_blocks, cu_q_lens, num_tokens: int, block_q: int, group: int):
    """`[NB, G, M, D]` per-block rows -> `[T, H, D]`; padding tokens get zeros.

    Row `r` of a block holds new token `q_start + r // group`, query head `g * group + r % group`.
    """
    batch = cu_q_lens.shape[0] - 1
    nb, num_kv_heads, _, head_dim = out_blocks.shape
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    blocks_before = (jnp.cumsum((q_lens + block_q - 1) // block_q) - (q_lens + block_q - 1) // block_q)
    req = request_of(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32))
    valid = req < batch
    req_c = jnp.minimum(req, batch - 1)
    j = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[req_c]
    blk = jnp.clip(blocks_before[req_c] + j // block_q, 0, nb - 1)
    row0 = (j % block_q) * group
    rows = row0[:, None] + jnp.arange(group, dtype=jnp.int32)[None, :]  # [T, Hg]
    g = jnp.arange(num_kv_heads, dtype=jnp.int32)
    out = out_blocks[blk[:, None, None], g[None, :, None], rows[:, None, :]]  # [T, G, Hg, D]
    out = jnp.where(valid[:, None, None, None], out, 0)
    return out.reshape(num_tokens, num_kv_heads * group, head_dim)
