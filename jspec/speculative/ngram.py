"""NGRAM drafting on the device: propose the tokens that followed the latest earlier occurrence of
the request's own most recent tokens (prompt + output), longest matching window first.

Each request slot keeps its token history `[H]` on the device (`spec_state["history"]`: the token
at every KV position, written by prefill and by each speculative step), so a step drafts from
tokens the host has not read yet and the overlapped loop (spec v2) works for NGRAM as for the model
drafters. Matching is a dense compare of the suffix against every earlier window, O(H x max_window)
per request and step: element-wise work that XLA fuses, far below the cost of the verify forward.

Semantics (the host reference in tests/jspec/speculative/test_spec_ngram.py): with the newest token at index L, for n
from min(max_window, L + 1) down to min_window, the candidate windows end at e in [n - 1, L - 1]; the
first n with a match takes its latest e, and the draft is history[e + 1 .. e + S], cut at L and
padded with its last token; without a match the draft is the newest token repeated. A draft is
only a guess: verification decides, so a wrong guess costs acceptance, never correctness.
"""

from __future__ import annotations

import jax.numpy as jnp


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


def write(history, slots, valid, start, tokens):
    """history with `tokens` `[B, T]` written at positions start .. start + T - 1 of each valid
    request's slot (positions past H, and padding rows, are dropped)."""
    oob = history.shape[0]
    t = tokens.shape[1]
    rows = jnp.where(valid, slots, oob)[:, None]
    cols = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return history.at[jnp.broadcast_to(rows, cols.shape), cols].set(tokens.astype(history.dtype), mode="drop")
