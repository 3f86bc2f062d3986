"""One speculative decode step for a chain drafter without hidden states: a draft model
(STANDALONE) or n-gram matches in the request's own token history (NGRAM, `spec/ngram.py`).

Everything on device, one jitted function per batch bucket:
1. draft: S + 1 decode forwards of the draft model from each request's last token (the last one
   only writes the draft KV of the S-th draft token, so a fully accepted chain leaves the draft
   cache complete); the draft samples from its own filtered distribution q for sampling rows.
   NGRAM instead matches the newest tokens against the slot's token history on the device;
2. verify: one target forward over [last, d1 .. dS] at KV indices L0 .. L0+S (`spec/verify.py`);
3. accept (`spec/accept.py`), then commit the accepted node's Gated-DeltaNet state (hybrid targets);
4. the bonus becomes the request's next input (`last_token`); KV written for rejected tokens lies
   past the new length and is overwritten by the next step before anything reads it (so are the
   rejected tokens NGRAM writes into its history).
Output row: [number of tokens produced (n + 1), tokens..., -1 padding].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.runtime import sampler as sampling
from jspec.runtime.step import DeviceState, _apply_page_updates
from jspec.runtime.step_inputs import Bucket
from jspec.spec import accept, ngram, verify


def step_common(bucket: Bucket, state: DeviceState, packed, num_keys: int):
    """Unpack a spec bucket: (x, req_to_page, slots, valid, l0, page_table, sampling batch, greedy, key_fn)."""
    x = bucket.unpack(packed)
    req_to_page = _apply_page_updates(state.req_to_page, x["page_updates"])
    slots = x["req_slots"]
    valid = x["seq_lens"] > 0  # padding rows carry seq_len 0
    # KV index of each request's last token (not yet in the KV), from the device: with overlap the
    # host plans this step before it knows what the previous one accepted. Its output index moves
    # with it, so it is the host's (output index - position) plus the device's position.
    l0 = jnp.where(valid, state.seq_lens[slots], 0)
    x["out_index"] = l0 + x["out_index"] - x["positions"][:bucket.batch_size]
    sb = sampling.SamplingBatch(
        temperature=x["temperature"], top_p=x["top_p"], top_k=x["top_k"], min_p=x["min_p"],
        repetition_penalty=x["repetition_penalty"], frequency_penalty=x["frequency_penalty"],
        presence_penalty=x["presence_penalty"], seed=x["seeds"], step=x["out_index"],
    )
    greedy = x["temperature"] < sampling.GREEDY_TEMPERATURE

    def key_fn(k: int):
        # One stream per request, indexed by (index of the step's first output, use k): the same
        # tokens whatever else is in the batch.
        return jax.vmap(lambda sd, st: sampling._row_key(sd, st * num_keys + k))(x["seeds"], x["out_index"])

    return x, req_to_page, slots, valid, l0, req_to_page[slots], sb, greedy, key_fn


def next_state(state: DeviceState, *, caches, req_to_page, slots, valid, l0, n, bonus, draft_caches,
               spec_state) -> DeviceState:
    """The state after a speculative step: the bonus is each request's next input, and its KV
    length moves past its last token and the n kept drafts."""
    oob = state.last_token.shape[0]
    at = jnp.where(valid, slots, oob)
    return DeviceState(caches=caches, req_to_page=req_to_page,
                       last_token=state.last_token.at[at].set(bonus, mode="drop"),
                       output_counts=state.output_counts, prompt_mask=state.prompt_mask,
                       draft_caches=draft_caches, spec_state=spec_state,
                       seq_lens=state.seq_lens.at[at].set(l0 + n + 1, mode="drop"))


def make_chain_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int,
                         simulate_accept_length: float | None = None, ngram_windows: tuple[int, int] | None = None):
    """ngram_windows: (min, max) match window of NGRAM, which drafts without a draft model."""
    b_cap, s = bucket.batch_size, num_steps

    def step(params, state: DeviceState, packed):
        # With a draft model params is (target, draft); NGRAM steps get the target's alone.
        target_params, draft_params = params if draft_graphdef is not None else (params, None)
        x, req_to_page, slots, valid, l0, page_table, sb, greedy, key_fn = step_common(
            bucket, state, packed, 2 * s + 2)
        last = state.last_token[slots]

        # 1. Draft, autoregressively, one token per request per forward (or by n-gram matching).
        dcaches, spec_state = state.draft_caches, state.spec_state
        if draft_graphdef is None:
            # The newest token sits at index l0 of the history: an earlier step sampled it.
            history = ngram.write(spec_state["history"], slots, valid, l0, last[:, None])
            d = ngram.propose(history[slots], l0, s, *ngram_windows)
            q_all = None  # point masses at the proposals
        else:
            draft = nnx.merge(draft_graphdef, draft_params)
            tok, drafts, qs = last, [], []
            for k in range(s + 1):
                batch = verify.decode_batch(tok, l0 + k, valid, page_table, slots, page_size)
                out, dcaches = draft(batch, dcaches, compute_logits=k < s)
                if k < s:
                    q = sampling.filtered_probs(out.logits, sb, sort=bucket.sort)  # [B, V]
                    drawn = jax.vmap(jax.random.categorical)(key_fn(s + 1 + k), jnp.log(q))
                    tok = jnp.where(greedy, jnp.argmax(out.logits, axis=-1), drawn).astype(jnp.int32)
                    drafts.append(tok)
                    qs.append(q)
            d, q_all = jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1)  # [B, S], [B, S, V]

        # 2. Verify all S + 1 tokens of every request in one target forward.
        vt = jnp.concatenate([last[:, None], d], axis=1)  # [B, S+1]
        target = nnx.merge(graphdef, target_params)
        out, caches = target(verify.verify_batch(vt, l0, valid, page_table, slots, page_size), state.caches)
        logits = out.logits.reshape(b_cap, s + 1, -1)

        # 3. Accept, commit the hybrid state of the last kept node.
        if simulate_accept_length is None:
            n, bonus = accept.chain(logits, d, q_all, sb, greedy, key_fn, sort=bucket.sort)
        else:
            n, bonus = accept.simulated(logits, key_fn, simulate_accept_length, s, sb, greedy, sort=bucket.sort)
        caches = verify.commit(caches, out.gdn_scratch, slots, jnp.where(valid, n, -1))
        if draft_graphdef is None:  # the drafts (those past n are overwritten later), then the bonus
            history = ngram.write(history, slots, valid, l0 + 1, d)
            spec_state = {"history": ngram.write(history, slots, valid, l0 + n + 1, bonus[:, None])}

        new_state = next_state(state, caches=caches, req_to_page=req_to_page, slots=slots, valid=valid, l0=l0,
                               n=n, bonus=bonus, draft_caches=dcaches, spec_state=spec_state)
        return new_state, accept.output_rows(d, n, bonus, valid)

    return step
