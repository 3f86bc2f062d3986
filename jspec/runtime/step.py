"""The jitted step: packed inputs -> model forward -> on-device sampling -> updated device state.

Everything a step needs from earlier steps lives on the device, indexed by request slot:
`req_to_page` (page table rows, patched by this step's page updates), `last_token` (the token each
request sampled last, the next decode input), and the penalty state. So the host can dispatch step
N+1 before it has read step N's tokens (overlap), and sends only small int32 vectors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models.batch import Caches, ForwardBatch
from jspec.runtime import sampler as sampling
from jspec.runtime.scheduler import TOKEN_FROM_DEVICE, TOKEN_PAD, TOKEN_PROMPT, TOKEN_REFED_OUTPUT
from jspec.runtime.step_inputs import Bucket
from pallas_kernels.paged_attention.reference import token_request_index


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    """Per-engine device buffers; donated to every step and returned updated."""

    caches: Caches
    req_to_page: jax.Array  # [num_slots, pages_per_seq] int32
    last_token: jax.Array  # [num_slots] int32
    output_counts: jax.Array  # [num_slots, V] int32: output tokens so far (frequency/presence penalty)
    prompt_mask: jax.Array  # [num_slots, V] bool: tokens of the prompt (repetition penalty)
    draft_caches: Caches | None = None  # a drafter's own KV (same page table), when speculating
    # What a hidden-state drafter (EAGLE family) carries from one step to the next, per slot:
    # "tokens" [num_slots, K] its top-K proposals for the next position, "logp" [num_slots, K]
    # their log-probabilities, "hidden" [num_slots, E] the hidden it feeds back.
    spec_state: dict | None = None
    # Speculating: each slot's KV length (= the position of its last token), kept on the device so
    # the host can plan step N+1 before it knows how many tokens step N accepted (spec v2).
    seq_lens: jax.Array | None = None


def _apply_page_updates(req_to_page, updates):
    slot, idx, page = updates[:, 0], updates[:, 1], updates[:, 2]
    slot = jnp.where(slot < 0, req_to_page.shape[0], slot)  # padding rows: dropped
    return req_to_page.at[slot, idx].set(page, mode="drop")


def make_step(graphdef, bucket: Bucket, *, page_size: int, num_top_logprobs: int, draft_graphdef=None,
              draft_kind: str | None = None):
    """The step function for one bucket: (params, DeviceState, packed int32) -> (DeviceState, out).

    With a drafter (`draft_graphdef`), params is (target params, draft params). A draft model
    (draft_kind "model", STANDALONE) runs over the same tokens, pages and positions, so its KV cache
    tracks the target's; a hidden-state drafter ("eagle": EAGLE, EAGLE3, NEXTN) runs over the same
    positions with the tokens shifted by one and the target's hidden states (`spec/eagle_step.py`);
    a block drafter ("dflash") stores the prompt's context and drafts its first block
    (`spec/dflash_step.py`); NGRAM ("ngram") records the tokens in its per-slot history
    (`spec/ngram.py`)."""

    def step(params, state: DeviceState, packed):
        draft_params = None
        if draft_graphdef is not None:
            params, draft_params = params
        x = bucket.unpack(packed)
        t_cap = bucket.num_tokens
        req_to_page = _apply_page_updates(state.req_to_page, x["page_updates"])
        slots = x["req_slots"]
        cu = x["cu_q_lens"]

        # Token -> request; tokens past cu[B] are padding.
        req_of_tok = token_request_index(cu, t_cap)
        valid_tok = req_of_tok < bucket.batch_size
        req_c = jnp.minimum(req_of_tok, bucket.batch_size - 1)
        tok_slot = slots[req_c]
        kind = jnp.where(valid_tok, x["token_kind"], TOKEN_PAD)
        input_ids = jnp.where(kind == TOKEN_FROM_DEVICE, state.last_token[tok_slot], x["input_ids"])
        input_ids = jnp.where(valid_tok, input_ids, 0)

        page_table = req_to_page[slots]  # [B, pages_per_seq]
        pos = x["positions"]
        page = jnp.take_along_axis(page_table[req_c], (pos // page_size)[:, None], axis=1)[:, 0]
        slot_mapping = jnp.where(valid_tok, page * page_size + pos % page_size, -1)
        # Decode padding rows own one dummy token each; their slot's page-table row is all sink
        # pages, so its KV lands in page 0, which no request reads.

        batch = ForwardBatch(
            input_ids=input_ids, positions=pos, seq_lens=x["seq_lens"], cu_q_lens=cu, page_table=page_table,
            slot_mapping=slot_mapping, state_slots=slots, has_initial_state=x["has_initial"] > 0,
            mode=bucket.mode,
        )
        last_idx = jnp.maximum(cu[1:] - 1, 0)
        module = nnx.merge(graphdef, params)
        draft = None if draft_graphdef is None else nnx.merge(draft_graphdef, draft_params)
        eagle = draft_kind == "eagle"
        reads_hidden = draft_kind in ("eagle", "dflash")
        out, caches = module(batch, state.caches, logits_indices=last_idx,
                             capture_layers=draft.capture_layers if reads_hidden else (), all_hidden=reads_hidden)
        draft_caches = state.draft_caches
        if draft_kind == "model":
            _, draft_caches = draft(batch, draft_caches, logits_indices=last_idx, compute_logits=False)

        # Penalty state: reset on (re)admission, then count this step's prompt / re-fed tokens.
        # Only extend steps admit requests or feed prompts, so decode steps skip these [B, V] scatters.
        counts, prompt_mask = state.output_counts, state.prompt_mask
        oob = counts.shape[0]
        if bucket.mode == "extend":
            reset_slots = jnp.where(x["reset_mask"] > 0, slots, oob)
            counts = counts.at[reset_slots].set(0, mode="drop")
            prompt_mask = prompt_mask.at[reset_slots].set(False, mode="drop")
            prompt_slot = jnp.where(kind == TOKEN_PROMPT, tok_slot, oob)
            prompt_mask = prompt_mask.at[prompt_slot, input_ids].set(True, mode="drop")
            refed_slot = jnp.where(kind == TOKEN_REFED_OUTPUT, tok_slot, oob)
            counts = counts.at[refed_slot, input_ids].add(1, mode="drop")

        sb = sampling.SamplingBatch(
            temperature=x["temperature"], top_p=x["top_p"], top_k=x["top_k"], min_p=x["min_p"],
            repetition_penalty=x["repetition_penalty"], frequency_penalty=x["frequency_penalty"],
            presence_penalty=x["presence_penalty"], seed=x["seeds"], step=x["out_index"],
        )
        so = sampling.sample(out.logits, sb, counts[slots], prompt_mask[slots], num_top_logprobs=num_top_logprobs,
                             sort=bucket.sort)
        sampled = x["sample_mask"] > 0
        tokens = jnp.where(sampled, so.tokens, -1).astype(jnp.int32)

        write_slot = jnp.where(sampled, slots, oob)
        last_token = state.last_token.at[write_slot].set(so.tokens, mode="drop")
        counts = counts.at[write_slot, jnp.maximum(so.tokens, 0)].add(1, mode="drop")

        spec_state, seq_lens = state.spec_state, state.seq_lens
        if seq_lens is not None:  # a finished prompt: the sampled token sits at index seq_len
            seq_lens = seq_lens.at[write_slot].set(x["seq_lens"], mode="drop")
        if eagle:
            from jspec.spec.eagle_step import prefill_draft

            # -1: the request's newest token, which this step just sampled (or an earlier one did).
            next_ids = jnp.where(x["next_ids"] >= 0, x["next_ids"], last_token[tok_slot])
            next_ids = jnp.where(valid_tok, next_ids, 0)
            draft_caches, spec_state = prefill_draft(draft, module, draft_caches, batch, out, next_ids, sampled,
                                                     last_idx, spec_state, spec_state["tokens"].shape[1])
        if draft_kind == "ngram":  # every token fed here, at its position, into the slot's history
            history = spec_state["history"]
            at = jnp.where(valid_tok, tok_slot, history.shape[0])
            spec_state = {"history": history.at[at, pos].set(input_ids, mode="drop")}
        if draft_kind == "dflash":
            from jspec.spec.dflash_step import prefill_dflash

            draft_caches, spec_state = prefill_dflash(draft, module, draft_caches, batch, out, sampled,
                                                      x["seq_lens"], so.tokens, page_table, spec_state, page_size)

        packed_out = jnp.concatenate(
            [
                tokens[:, None],
                jax.lax.bitcast_convert_type(so.logprobs.astype(jnp.float32), jnp.int32)[:, None],
                so.top_ids.astype(jnp.int32),
                jax.lax.bitcast_convert_type(so.top_logprobs.astype(jnp.float32), jnp.int32),
            ],
            axis=1,
        )
        new_state = DeviceState(caches=caches, req_to_page=req_to_page, last_token=last_token,
                                output_counts=counts, prompt_mask=prompt_mask, draft_caches=draft_caches,
                                spec_state=spec_state, seq_lens=seq_lens)
        return new_state, packed_out

    return step
