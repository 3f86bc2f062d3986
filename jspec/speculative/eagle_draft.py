"""What a hidden-state drafter (EAGLE, EAGLE3, NEXTN / MTP) does outside the target's forwards.

A drafter reads the target's hidden states, so it lags the target by one token: at KV index p it
consumes the token at p + 1 with the target's hidden at p, and predicts the token at p + 2. What it
needs between steps is carried on the device per request slot (`DeviceState.spec_state`): its top-K
proposals for the token after the request's last token ("tokens" `[slots, K]`), their
log-probabilities ("logp" `[slots, K]`) and the hidden it feeds back ("hidden" `[slots, E]`).

After every prompt chunk (`prefill_draft`) and every verify (`catch_up`) the drafter extends over
the same positions as the target, so its KV matches what was accepted and its output at the last
accepted position gives the next proposals.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models import ops
from jspec.speculative import verify


def init_spec_state(num_slots: int, hidden_size: int, dtype, topk: int = 1) -> dict:
    return {
        "tokens": jnp.zeros((num_slots, topk), jnp.int32),
        "logp": jnp.zeros((num_slots, topk), jnp.float32),
        "hidden": jnp.zeros((num_slots, hidden_size), dtype),
    }


def proposals(drafter, out, topk: int, target):
    """Top-K draft proposals (target ids) and their log-probabilities from a DraftOutput. Logits
    from a split target's lm_head stay split: each device ranks its own slice and only the
    candidates cross devices (`ops.vocab_top_k`), never whole rows."""
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    tp = drafter.vocab_shards(target)
    # Unsplit logits keep XLA's top_k (k is small here; ops.top_k's kernel is tuned for the sampler).
    lp, ids = jax.lax.top_k(logp, topk) if tp == 1 else ops.vocab_top_k(logp, topk, tp=tp)
    return drafter.to_target_ids(ids.astype(jnp.int32)).astype(jnp.int32), lp


def store(spec_state: dict, slots, rows_mask, tokens, logp, hidden) -> dict:
    """Write the carried proposals / hidden of the rows in `rows_mask` to their slots."""
    at = jnp.where(rows_mask, slots, spec_state["tokens"].shape[0])
    return {
        "tokens": spec_state["tokens"].at[at].set(tokens, mode="drop"),
        "logp": spec_state["logp"].at[at].set(logp, mode="drop"),
        "hidden": spec_state["hidden"].at[at].set(hidden.astype(spec_state["hidden"].dtype), mode="drop"),
    }


def prefill_draft(drafter, target, dcaches, batch, target_out, next_ids, rows_done, logits_indices, spec_state,
                  topk: int):
    """The drafter's catch-up over a prefill chunk: token ids shifted by one (`next_ids` [T], the
    token at KV index p + 1 for the token at p) with the target's hidden at p. Requests whose
    prompt ends in this step (`rows_done` [B]) get their first proposals stored."""
    shifted = dataclasses.replace(batch, input_ids=next_ids)
    out, dcaches = drafter(shifted, dcaches, drafter.target_hidden(target_out), target=target,
                           logits_indices=logits_indices)
    tokens, logp = proposals(drafter, out, topk, target)
    return dcaches, store(spec_state, batch.state_slots, rows_done, tokens, logp, out.hidden)


def catch_up(drafter, target, dcaches, spec, kept, n, bonus, hidden, l0, valid, page_table, slots,
             page_size: int):
    """The drafter's catch-up over the S + 1 verified positions L0 .. L0+S: node j's next token is
    the kept draft kept[j] for j < n and the bonus at n; later nodes were rejected and their
    outputs go unused (their KV lies past the new length and is overwritten before it is read).
    hidden `[B*(S+1), Hin]`: the target's hidden at those positions (along the accepted path for a
    tree). Its output at L0 + n gives the carried proposals and hidden. Returns (draft caches,
    spec_state)."""
    b, s = kept.shape
    j = jnp.arange(s + 1)[None, :]
    d_next = jnp.concatenate([kept, jnp.zeros((b, 1), jnp.int32)], axis=1)
    ext_tokens = jnp.where(j < n[:, None], d_next, bonus[:, None])
    ebatch = verify.extend_batch(ext_tokens, l0, valid, page_table, slots, page_size)
    rows = jnp.arange(b) * (s + 1) + n
    dout, dcaches = drafter(ebatch, dcaches, hidden, target=target, logits_indices=rows)
    tokens, logp = proposals(drafter, dout, spec["tokens"].shape[1], target)
    return dcaches, store(spec, slots, valid, tokens, logp, dout.hidden)
