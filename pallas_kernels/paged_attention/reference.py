"""Paged attention in pure jnp: the oracle for the Pallas kernels and the CPU path of the engine.

Layout (DESIGN.md §3): per layer, K and V pages `[P, L, G, D]`; a request's page table row lists
its pages in order, so its token at KV index `s` sits in page `page_table[b, s // L]`, row `s % L`.

A step processes `T` new tokens, ragged across `B` requests: request `b` owns tokens
`cu_q_lens[b] : cu_q_lens[b + 1]`; tokens past `cu_q_lens[B]` are padding. Before attention, the new
tokens' K/V are written into their slots (`write_kv`), so attention only ever reads pages.
`seq_lens[b]` counts the request's KV entries *including* this step's, so its j-th new token sits at
KV index `seq_lens[b] - q_len[b] + j`.

Masks (`mask_mode`):
- "causal": KV index <= the query's own KV index (prefill chunks, decode, linear-chain verify).
- "tree":   the cached prefix plus the new tokens that `custom_mask[b, j, k]` allows (EAGLE trees).
- "full":   the whole sequence including every new token (DFlash's non-causal draft block).

Slots that a request does not own (other pages, the tail of its last page) may hold anything,
NaN included: every read here is masked before it can reach the output.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.rms_norm.reference import rms_norm

MASK_MODES = ("causal", "tree", "full")


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Scatter new K/V `[T, G, D]` into pages `[P, L, G, D]` at flat slots `page * L + row`.

    A negative slot marks a padding token: nothing is written for it.
    """
    num_pages, page_size = k_pages.shape[:2]
    flat_shape = (num_pages * page_size,) + k_pages.shape[2:]
    # Route padding to an out-of-bounds index and let `mode="drop"` discard it.
    slots = jnp.where(slot_mapping < 0, num_pages * page_size, slot_mapping)
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter as a dynamic-update-slice guarded by a select that reads
        # the old row, and then copies the whole donated page buffer every step (on the CPU,
        # batch-1 decode ran many times slower than batch 2; NOTES.md). A dropped second row keeps
        # it a scatter.
        slots = jnp.concatenate([slots, jnp.full((1,), num_pages * page_size, slots.dtype)])
        k_new, v_new = jnp.concatenate([k_new, k_new]), jnp.concatenate([v_new, v_new])
    k_flat = k_pages.reshape(flat_shape).at[slots].set(k_new.astype(k_pages.dtype), mode="drop")
    v_flat = v_pages.reshape(flat_shape).at[slots].set(v_new.astype(v_pages.dtype), mode="drop")
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def token_request_index(cu_q_lens, num_tokens):
    """Request index `[T]` of every token; padding tokens get `B` (one past the last request)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)


def _gather_pages(pages, page_table):
    """`[P, L, G, D]` x `[B, Pmax]` -> `[B, Pmax * L, G, D]` (the request's KV in index order)."""
    b, pmax = page_table.shape
    g = pages[page_table]  # [B, Pmax, L, G, D]
    return g.reshape((b, pmax * pages.shape[1]) + pages.shape[2:])


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
):
    """Ragged attention of new tokens over their requests' paged KV.

    q: `[T, H, D]`; k_pages, v_pages: `[P, L, G, D]`; page_table: `[B, Pmax]` int32;
    seq_lens: `[B]` int32 (KV length including this step); cu_q_lens: `[B + 1]` int32;
    custom_mask: `[B, N, N]` bool for mask_mode="tree" (row j: which new tokens query j sees).
    Returns `[T, H, D]` in q's dtype; padding tokens and requests with no KV give zeros.
    """
    if mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
    if mask_mode == "tree" and custom_mask is None:
        raise ValueError("mask_mode='tree' needs custom_mask [B, N, N]")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    batch = page_table.shape[0]

    req = token_request_index(cu_q_lens, num_tokens)  # [T]
    valid_tok = req < batch
    req_c = jnp.minimum(req, batch - 1)
    q_len = (cu_q_lens[1:] - cu_q_lens[:-1])[req_c]  # [T]
    j = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[req_c]  # index among the request's new tokens
    seq_len = seq_lens[req_c]
    prefix = seq_len - q_len
    q_idx = prefix + j  # the query's own KV index

    keys = _gather_pages(k_pages, page_table)[req_c]  # [T, S, G, D]
    vals = _gather_pages(v_pages, page_table)[req_c]
    s = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :]  # [1, S]

    in_seq = s < seq_len[:, None]
    if mask_mode == "causal":
        allowed = s <= q_idx[:, None]
    elif mask_mode == "full":
        allowed = jnp.ones_like(in_seq)
    else:
        n = custom_mask.shape[-1]
        rel = s - prefix[:, None]  # position among the new tokens
        rows = custom_mask[req_c, jnp.clip(j, 0, n - 1)]  # [T, N]
        tree_ok = jnp.take_along_axis(rows, jnp.clip(rel, 0, n - 1), axis=1)
        allowed = (rel < 0) | ((rel < n) & tree_ok)
    mask = in_seq & allowed & valid_tok[:, None]  # [T, S]

    # Zero what is not ours before the products: 0 * NaN would leak poison through the softmax.
    keys = jnp.where(mask[:, :, None, None], keys, 0).astype(jnp.float32)
    vals = jnp.where(mask[:, :, None, None], vals, 0).astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tgqd,tsgd->tgqs", qf, keys) * sm_scale
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tgqs,tsgd->tgqd", p, vals) / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def paged_decode(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale: float):
    """One query token per request: q `[B, H, D]` over KV `[0, seq_lens[b])`. Returns `[B, H, D]`."""
    batch = q.shape[0]
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    # Requests with seq_len 0 (batch padding) still map one token each; the mask empties them.
    return paged_attention(q, k_pages, v_pages, page_table, seq_lens, cu, sm_scale=sm_scale)


__all__ = ["write_kv", "paged_attention", "paged_decode", "token_request_index", "rope", "norm_rope_write",
           "MASK_MODES"]


def rope(x, cos, sin):
    """Rotate-half rotary embedding of x `[T, heads, D]` over its first rotary_dim channels."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    xf = x_rot.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)
    return out if x_pass.shape[-1] == 0 else jnp.concatenate([out, x_pass], axis=-1)


def norm_rope_write(qkv, cos, sin, q_norm, k_norm, k_pages, v_pages, slot_mapping, *, num_heads: int, eps: float,
                    zero_centred: bool, gated: bool = False):
    """qkv `[T, H * Dq + 2G * D]` (q heads, k heads, v heads; Dq = 2D with `gated`, each q head
    [query D | gate D]) -> q `[T, H, D]` (queries only), k and v `[T, G, D]`, k and v also written
    into pages `[P, L, G, D]` at their slots (negative: skipped). q and k are RMS-normed per head by
    q_norm / k_norm `[D]` (both None: no norm), then rotated by cos / sin `[T, rotary_dim]` over
    their first rotary_dim channels. Returns (q, k, v, k_pages, v_pages)."""
    g, d = k_pages.shape[2], k_pages.shape[3]
    t = qkv.shape[0]
    qw = num_heads * d * (2 if gated else 1)
    q = qkv[:, :qw].reshape(t, num_heads, -1)[..., :d]
    k = qkv[:, qw:qw + g * d].reshape(t, g, d)
    v = qkv[:, qw + g * d:].reshape(t, g, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps=eps, zero_centred=zero_centred)
        k = rms_norm(k, k_norm, eps=eps, zero_centred=zero_centred)
    k = rope(k, cos, sin)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slot_mapping)
    return rope(q, cos, sin), k, v, k_pages, v_pages
