"""NGRAM drafting on the device: propose the tokens that followed the latest earlier occurrence of
the request's own most recent tokens (prompt + output), longest matching window first.

The token history lives on the device in pages beside the KV (`spec_state["history"]`
`[num_pages, page_size]`: the token at every KV index, written by prefill and by each speculative
step, read through the request's page-table row as `[H]`), so a step drafts from tokens the host has
not read yet, the overlapped loop (spec v2) works for NGRAM as for the model drafters, and a request
that reuses cached pages finds their tokens there. Matching is a dense compare of the suffix against
every earlier window, O(H x max_window) per request and step: element-wise work that XLA fuses, far
below the cost of the verify forward.

Semantics (the host reference in tests/jspec/speculative/test_spec_ngram.py): with the newest token at index L, for n
from min(max_window, L + 1) down to min_window, the candidate windows end at e in [n - 1, L - 1]; the
first n with a match takes its latest e, and the draft is history[e + 1 .. e + S], cut at L and
padded with its last token; without a match the draft is the newest token repeated. A draft is
only a guess: verification decides, so a wrong guess costs acceptance, never correctness.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.runtime.step_inputs import kv_slots


def propose(history, last_index, num_tokens: int, min_window: int, max_window: int):
    """Draft tokens `[B, S]` from histories `[B, H]` whose newest token is at `last_index` `[B]`."""
    b, h = history.shape
    ends = jnp.arange(h, dtype=jnp.int32)[None, :]  # candidate window ends e
    last = last_index.astype(jnp.int32)[:, None]
    match = jnp.ones((b, h), jnp.bool_)  # window of the first j+1 tokens matches, ending at e
    best = jnp.full((b,), -1, jnp.int32)
    for j in range(max_window):
        shifted = jnp.pad(history, ((0, 0), (j, 0)), constant_values=-1)[:, :h]  # history[e - j]
        tail = jnp.take_along_axis(history, jnp.maximum(last - j, 0), axis=1)  # history[L - j]
        match = match & (shifted == tail) & (ends >= j) & (last - j >= 0)
        if j + 1 >= min_window:
            latest = jnp.max(jnp.where(match & (ends < last), ends, -1), axis=1)
            best = jnp.where(latest >= 0, latest, best)  # a longer window (later j) wins
    k = jnp.arange(1, num_tokens + 1, dtype=jnp.int32)[None, :]
    at = jnp.where(best[:, None] >= 0, jnp.minimum(best[:, None] + k, last), last)
    return jnp.take_along_axis(history, at, axis=1)


def init_history(num_pages: int, page_size: int) -> dict:
    return {"history": jnp.zeros((num_pages, page_size), jnp.int32)}


def gather(history, page_table):
    """Each request's history `[B, H]` (H = pages_per_seq * page_size) from the paged one."""
    return history[page_table].reshape(page_table.shape[0], -1)


def write_tokens(history, kv_index, tokens):
    """The paged history with tokens `[T]` written at flat KV indices `[T]` (page * page_size +
    offset; negative: dropped)."""
    flat = history.reshape(-1)
    at = jnp.where(kv_index >= 0, kv_index, flat.shape[0])
    return flat.at[at].set(tokens.astype(flat.dtype), mode="drop").reshape(history.shape)


def write(history, page_table, valid, start, tokens):
    """The paged history with `tokens` `[B, T]` written at positions start .. start + T - 1 of each
    valid request, through its page-table row as the KV is (padding rows are dropped)."""
    at = kv_slots(page_table, start, tokens.shape[1], history.shape[1], valid)
    return write_tokens(history, at.reshape(-1), tokens.reshape(-1))
