"""Public paged attention: ragged extend / tree verify / DFlash block, and decode.

Same contract as `reference.py` (read it for the meaning of every argument), plus `interpret`.
Each function is a thin shell around `kernel.py`: plan the query blocks (`query_blocks.py`), pick
static launch shapes (`kernel.choose`), run the kernel, merge KV splits (`combine.py`) and put rows
back in token order.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import query_blocks
from pallas_kernels.paged_attention.combine import combine_decode, combine_decode_supported, combine_splits
from pallas_kernels.paged_attention.kernel import attention_blocks, choose, extend_block_q, widest_block_q
from pallas_kernels.paged_attention.reference import MASK_MODES


def pack_tree_mask(custom_mask):
    """`[B, N, N]` bool -> `[B, N, ceil(N / 32)]` int32, bit k of word w = column 32 w + k.

    The kernel fetches one word per row once per program and tests bits per column, instead of
    gathering an N x N byte mask for every KV step.
    """
    b, n, _ = custom_mask.shape
    words = -(-n // 32)
    padded = jnp.zeros((b, n, words * 32), jnp.uint32).at[:, :, :n].set(custom_mask.astype(jnp.uint32))
    bits = padded.reshape(b, n, words, 32) << jnp.arange(32, dtype=jnp.uint32)
    return lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)  # distinct bits: sum == or


def _finish(acc, m, l, dtype):
    return acc[:, :, 0] if m is None else combine_splits(acc, m, l, dtype)


def paged_attention_tuned(
    q,
    k_pages,
    v_pages,
    page_table,
    seq_lens,
    cu_q_lens,
    *,
    sm_scale: float,
    mask_mode: str = "causal",
    custom_mask=None,
    interpret: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """`paged_attention` with its launch shapes exposed (for benchmarks and tests)."""
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
    if mask_mode == "tree" and custom_mask is None:
        raise ValueError("mask_mode='tree' needs custom_mask [B, N, N]")
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    batch, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads

    if mask_mode == "tree":
        tree_words = pack_tree_mask(custom_mask)
        block_q = block_q or min(custom_mask.shape[-1], widest_block_q(head_dim, group))
    else:
        tree_words = jnp.zeros((1, 1, 1), jnp.int32)
        block_q = block_q or extend_block_q(num_tokens, batch, head_dim, group)
    nb = query_blocks.max_blocks(num_tokens, batch, block_q)
    cfg = choose(
        num_blocks=nb, block_q=block_q, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, pages_per_seq=pages_per_seq, block_kv=block_kv, splits=splits, num_warps=num_warps,
        num_stages=num_stages,
    )
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    blk_req, blk_q0 = query_blocks.plan(cu_q_lens, nb, block_q)
    acc, m, l = attention_blocks(
        q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, blk_req, blk_q0, tree_words,
        mode=mask_mode, cfg=cfg, sm_scale=sm_scale, interpret=interpret,
    )
    rows = _finish(acc, m, l, q.dtype)  # [NB, G, M, D]
    return query_blocks.gather_rows(rows, cu_q_lens, num_tokens, block_q, group)


def paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    seq_lens,
    cu_q_lens,
    *,
    sm_scale: float,
    mask_mode: str = "causal",
    custom_mask=None,
    interpret: bool = False,
):
    """Ragged attention of `q [T, H, D]` over paged KV; see `reference.paged_attention`."""
    return paged_attention_tuned(
        q, k_pages, v_pages, page_table, seq_lens, cu_q_lens,
        sm_scale=sm_scale, mask_mode=mask_mode, custom_mask=custom_mask, interpret=interpret,
    )


def paged_decode_tuned(
    q,
    k_pages,
    v_pages,
    page_table,
    seq_lens,
    *,
    sm_scale: float,
    interpret: bool = False,
    block_kv: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """`paged_decode` with its launch shapes exposed (for benchmarks and tests)."""
    batch, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    cfg = choose(
        num_blocks=batch, block_q=1, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, pages_per_seq=page_table.shape[1], block_kv=block_kv, splits=splits,
        num_warps=num_warps, num_stages=num_stages,
    )
    # One query block per request: no planning, and rows come back without a gather. The block
    # tables are computed from seq_lens (plus a zero XLA cannot prove): constant tables become an
    # iota or memset kernel in front of every layer's custom call, while a value of the step's
    # inputs is computed once and shared by all layers.
    zero = jnp.minimum(seq_lens[0], 0).astype(jnp.int32)
    blk_req = jnp.arange(batch, dtype=jnp.int32) + zero
    cu = jnp.arange(batch + 1, dtype=jnp.int32) + zero
    acc, m, l = attention_blocks(
        q, k_pages, v_pages, page_table, seq_lens, cu, blk_req, jnp.broadcast_to(zero, (batch,)),
        jnp.broadcast_to(zero, (1, 1, 1)), mode="causal", cfg=cfg, sm_scale=sm_scale, interpret=interpret,
    )
    if m is not None and combine_decode_supported(cfg.splits, cfg.rows, group):
        return combine_decode(acc, m, l, group, q.dtype, interpret=interpret)  # one kernel, [B, H, D]
    rows = _finish(acc, m, l, q.dtype)  # [B, G, M, D]
    return rows[:, :, :group].reshape(batch, num_heads, head_dim)


def paged_decode(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale: float, interpret: bool = False):
    """One query token per request: `q [B, H, D]` over KV `[0, seq_lens[b])`; see the reference."""
    return paged_decode_tuned(q, k_pages, v_pages, page_table, seq_lens, sm_scale=sm_scale, interpret=interpret)
