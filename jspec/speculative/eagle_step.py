"""One speculative decode step for a hidden-state drafter (EAGLE, EAGLE3, NEXTN / MTP), chain.

A drafter reads the target's hidden states, so it lags the target by one token: at KV index p it
consumes the token at p + 1 with the target's hidden at p, and predicts the token at p + 2. What
it needs between steps is carried on the device per request slot (`DeviceState.spec_state`): its
proposal d1 for the token after the request's last token, and the hidden it feeds back.

One jitted function per batch bucket:
1. draft: d1 is carried; S - 1 more decode forwards of the drafter at KV indices L0 .. L0+S-2,
   each feeding back its own hidden, give d2 .. dS (top-1, mapped to target ids);
2. verify [last, d1 .. dS] with the target (`spec/verify.py`), capturing the hidden states the
   drafter reads; accept (`spec/accept.py`: greedy, or rejection sampling with point-mass drafts,
   which is exact because the drafter's choice is deterministic); commit hybrid state;
3. extend the drafter over the S + 1 verified positions with tokens [d1 .. dn, bonus, ...] and the
   target's hidden states: its KV now matches what was accepted (positions past L0 + n hold
   garbage that the next step overwrites before reading), and its output at L0 + n gives the
   next d1 and hidden. Prefill does the same catch-up over the prompt (`prefill_draft`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.runtime.step import DeviceState
from jspec.runtime.step_inputs import Bucket
from jspec.spec import accept, verify
from jspec.spec.chain_step import next_state, step_common


def init_spec_state(num_slots: int, hidden_size: int, dtype, topk: int = 1) -> dict:
    return {
        "tokens": jnp.zeros((num_slots, topk), jnp.int32),
        "logp": jnp.zeros((num_slots, topk), jnp.float32),
        "hidden": jnp.zeros((num_slots, hidden_size), dtype),
    }


def proposals(drafter, out, topk: int):
    """Top-K draft proposals (target ids) and their log-probabilities from a DraftOutput."""
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    lp, ids = jax.lax.top_k(logp, topk)
    return drafter.to_target_ids(ids.astype(jnp.int32)).astype(jnp.int32), lp


def store(spec_state: dict, slots, rows_mask, tokens, logp, hidden) -> dict:
    """Write the carried proposals / hidden of the rows in `rows_mask` to their slots."""
    oob = spec_state["tokens"].shape[0]
    at = jnp.where(rows_mask, slots, oob)
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
    tokens, logp = proposals(drafter, out, topk)
    return dcaches, store(spec_state, batch.state_slots, rows_done, tokens, logp, out.hidden)


def catch_up(drafter, target, dcaches, spec, kept, n, bonus, hidden, l0, valid, page_table, slots,
             page_size: int):
    """The drafter's catch-up over the S + 1 verified positions L0 .. L0+S: node j's next token is
    the kept draft kept[j] for j < n and the bonus at n; later nodes were rejected and their
    outputs go unused. hidden `[B*(S+1), Hin]`: the target's hidden at those positions (along the
    accepted path for a tree). Its output at L0 + n gives the carried proposals and hidden.
    Returns (draft caches, spec_state)."""
    b, s = kept.shape
    j = jnp.arange(s + 1)[None, :]
    d_next = jnp.concatenate([kept, jnp.zeros((b, 1), jnp.int32)], axis=1)
    ext_tokens = jnp.where(j < n[:, None], d_next, bonus[:, None])
    ebatch = verify.extend_batch(ext_tokens, l0, valid, page_table, slots, page_size)
    rows = jnp.arange(b) * (s + 1) + n
    dout, dcaches = drafter(ebatch, dcaches, hidden, target=target, logits_indices=rows)
    tokens, logp = proposals(drafter, dout, spec["tokens"].shape[1])
    return dcaches, store(spec, slots, valid, tokens, logp, dout.hidden)


def cut_state(state: DeviceState, *, caches=None, dcaches=None) -> DeviceState:
    """The state after a cut step (benchmarks): what the phases so far wrote."""
    return DeviceState(caches=state.caches if caches is None else caches, req_to_page=state.req_to_page,
                       last_token=state.last_token, output_counts=state.output_counts,
                       prompt_mask=state.prompt_mask, draft_caches=dcaches, spec_state=state.spec_state,
                       seq_lens=state.seq_lens)


def make_eagle_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int,
                         simulate_accept_length: float | None = None, stop_after: str | None = None):
    """stop_after ("draft" | "verify" | "accept"): benchmarks only, a step cut after that phase
    (its work kept alive through the returned state and output), to time the phases cumulatively."""
    b_cap, s = bucket.batch_size, num_steps

    def step(params, state: DeviceState, packed):
        target_params, draft_params = params
        x, req_to_page, slots, valid, l0, page_table, sb, greedy, key_fn = step_common(bucket, state, packed, s + 1)
        target = nnx.merge(graphdef, target_params)
        drafter = nnx.merge(draft_graphdef, draft_params)
        dcaches, spec = state.draft_caches, state.spec_state
        last = state.last_token[slots]

        # 1. Draft: d1 carried, then S - 1 drafter forwards feeding back their own hidden.
        tok, hidden = spec["tokens"][slots, 0], spec["hidden"][slots]
        drafts = [tok]
        for i in range(1, s):
            batch = verify.decode_batch(tok, l0 + i - 1, valid, page_table, slots, page_size)
            out, dcaches = drafter(batch, dcaches, hidden, target=target)
            tok = proposals(drafter, out, 1)[0][:, 0]
            hidden = out.hidden
            drafts.append(tok)
        d = jnp.stack(drafts, axis=1)  # [B, S]
        if stop_after == "draft":
            return cut_state(state, dcaches=dcaches), d

        # 2. Verify, accept, commit.
        vt = jnp.concatenate([last[:, None], d], axis=1)  # [B, S+1]
        vbatch = verify.verify_batch(vt, l0, valid, page_table, slots, page_size)
        out, caches = target(vbatch, state.caches, capture_layers=drafter.capture_layers)
        logits = out.logits.reshape(b_cap, s + 1, -1)
        if stop_after == "verify":
            return cut_state(state, caches=caches, dcaches=dcaches), jnp.argmax(logits, axis=-1)
        if simulate_accept_length is None:
            n, bonus = accept.chain(logits, d, None, sb, greedy, key_fn, sort=bucket.sort)
        else:
            n, bonus = accept.simulated(logits, key_fn, simulate_accept_length, s, sb, greedy, sort=bucket.sort)
        caches = verify.commit(caches, out.gdn_scratch, slots, jnp.where(valid, n, -1))
        if stop_after == "accept":
            return cut_state(state, caches=caches, dcaches=dcaches), accept.output_rows(d, n, bonus, valid)

        # 3. Drafter catch-up over the verified positions.
        dcaches, spec = catch_up(drafter, target, dcaches, spec, d, n, bonus, drafter.target_hidden(out), l0, valid,
                                 page_table, slots, page_size)
        new_state = next_state(state, caches=caches, req_to_page=req_to_page, slots=slots, valid=valid, l0=l0,
                               n=n, bonus=bonus, draft_caches=dcaches, spec_state=spec)
        return new_state, accept.output_rows(d, n, bonus, valid)

    return step
