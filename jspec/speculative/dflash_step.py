"""One speculative decode step with a DFlash block drafter: verify the carried block, then draft
the next one in a single drafter forward.

What a request carries between steps (`DeviceState.spec_state["tokens"]` `[slots, S]`): the S
drafts of its next block. The drafter's context (K/V from the target's captured streams) covers
every token before the request's newest one. One jitted function per batch bucket:
1. verify [last, d1 .. dS] at KV indices L0 .. L0+S with the target (`spec/verify.py`), capturing
   the streams the drafter reads; accept (`spec/accept.py`; the drafts are the drafter's argmax,
   so point masses: exact rejection sampling); commit hybrid state;
2. write the drafter context of all S+1 verified positions: those past L0 + n were rejected, and
   the block below overwrites every one of them before anything reads it;
3. the block [bonus, mask x S] at L0+n+1 .. L0+n+S+1 attends to the context and to itself (no
   causal mask) and gives the next S drafts.
Prefill does 2 and 3 over the prompt (`prefill_dflash`), so the first spec step has drafts.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jspec.runtime.step import DeviceState
from jspec.runtime.step_inputs import Bucket
from jspec.spec import accept, verify
from jspec.spec.chain_step import next_state, step_common
from jspec.spec.eagle_step import cut_state


def init_spec_state(num_slots: int, num_drafts: int) -> dict:
    return {"tokens": jnp.zeros((num_slots, num_drafts), jnp.int32)}


def draft_block(drafter, target, dcaches, first, start, valid, page_table, slots, page_size: int, num_drafts: int):
    """Blocks [first, mask x S] at KV indices start .. start + S; returns (drafts `[B, S]`, caches)."""
    b = first.shape[0]
    n = num_drafts + 1
    tokens = jnp.concatenate([first[:, None], jnp.full((b, num_drafts), drafter.mask_token_id, jnp.int32)], axis=1)
    full = jnp.ones((b, n, n), bool)  # every block token sees every other one
    batch = verify.verify_batch(tokens, start, valid, page_table, slots, page_size, tree_mask=full)
    rows = (jnp.arange(b)[:, None] * n + jnp.arange(1, n)[None, :]).reshape(-1)
    out, dcaches = drafter(batch, dcaches, target=target, logits_indices=rows)
    drafts = jnp.argmax(out.logits, axis=-1).astype(jnp.int32).reshape(b, num_drafts)
    return drafts, dcaches


def store(spec_state: dict, slots, rows_mask, drafts) -> dict:
    oob = spec_state["tokens"].shape[0]
    return {"tokens": spec_state["tokens"].at[jnp.where(rows_mask, slots, oob)].set(drafts, mode="drop")}


def prefill_dflash(drafter, target, dcaches, batch, target_out, rows_done, seq_lens, first, page_table, spec_state,
                   page_size: int):
    """A prefill chunk's context; requests whose prompt ends here (`rows_done` `[B]`, with their
    sampled token `first` at KV index seq_lens) get their first block drafted."""
    dcaches = drafter.write_context(batch, dcaches, drafter.target_hidden(target_out))
    drafts, dcaches = draft_block(drafter, target, dcaches, first, seq_lens, rows_done, page_table,
                                  batch.state_slots, page_size, spec_state["tokens"].shape[1])
    return dcaches, store(spec_state, batch.state_slots, rows_done, drafts)


def make_dflash_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int,
                          simulate_accept_length: float | None = None, stop_after: str | None = None):
    """num_steps: S = block size - 1 drafts per step. stop_after ("verify" | "accept"): benchmarks
    only, as in `make_eagle_spec_step` (there is no separate draft phase to cut after)."""
    b_cap, s = bucket.batch_size, num_steps

    def step(params, state: DeviceState, packed):
        target_params, draft_params = params
        x, req_to_page, slots, valid, l0, page_table, sb, greedy, key_fn = step_common(bucket, state, packed, s + 1)
        target = nnx.merge(graphdef, target_params)
        drafter = nnx.merge(draft_graphdef, draft_params)
        dcaches, spec = state.draft_caches, state.spec_state
        last = state.last_token[slots]
        d = spec["tokens"][slots]  # [B, S]

        # 1. Verify, accept, commit.
        vt = jnp.concatenate([last[:, None], d], axis=1)
        vbatch = verify.verify_batch(vt, l0, valid, page_table, slots, page_size)
        out, caches = target(vbatch, state.caches, capture_layers=drafter.capture_layers)
        logits = out.logits.reshape(b_cap, s + 1, -1)
        if stop_after == "verify":
            return cut_state(state, caches=caches), jnp.argmax(logits, axis=-1)
        if simulate_accept_length is None:
            n, bonus = accept.chain(logits, d, None, sb, greedy, key_fn, sort=bucket.sort)
        else:
            n, bonus = accept.simulated(logits, key_fn, simulate_accept_length, s, sb, greedy, sort=bucket.sort)
        caches = verify.commit(caches, out.gdn_scratch, slots, jnp.where(valid, n, -1))
        if stop_after == "accept":
            return cut_state(state, caches=caches), accept.output_rows(d, n, bonus, valid)

        # 2. Context of the verified positions; 3. the next block.
        dcaches = drafter.write_context(vbatch, dcaches, drafter.target_hidden(out))
        drafts, dcaches = draft_block(drafter, target, dcaches, bonus, l0 + n + 1, valid, page_table, slots,
                                      page_size, s)
        new_state = next_state(state, caches=caches, req_to_page=req_to_page, slots=slots, valid=valid, l0=l0,
                               n=n, bonus=bonus, draft_caches=dcaches, spec_state=store(spec, slots, valid, drafts))
        return new_state, accept.output_rows(d, n, bonus, valid)

    return step
