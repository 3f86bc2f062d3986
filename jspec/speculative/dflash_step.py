"""The speculative decode step of a DFlash block drafter: verify the carried block, then draft the
next one in a single drafter forward.

What a request carries between steps (`DeviceState.spec_state["tokens"]` `[slots, S]`): the S
drafts of its next block. The drafter's context (K/V from the target's captured streams) covers
every token before the request's newest one. Phases over one `SpecStep` carry (`step_common.py`):
1. verify [last, d1 .. dS] at KV indices L0 .. L0+S with the target (`verify.py`), capturing
   the streams the drafter reads; accept (`accept.py`; the drafts are the drafter's argmax,
   so point masses: exact rejection sampling); commit hybrid state;
2. write the drafter context of all S+1 verified positions: those past L0 + n were rejected, and
   the block below overwrites every one of them before anything reads it;
3. the block [bonus, mask x S] at L0+n+1 .. L0+n+S+1 attends to the context and to itself (no
   causal mask) and gives the next S drafts.
Prefill does 2 and 3 over the prompt (`prefill_dflash`), so the first spec step has drafts.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.models import ops
from jspec.runtime.step_inputs import Bucket, SpecRows
from jspec.speculative import verify
from jspec.speculative.step_common import Phase, SpecStep, accept_chain, begin, compose


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
    # The target's lm_head: split over the vocabulary at tp > 1, so each device takes its slice's argmax.
    drafts = ops.vocab_argmax(out.logits, tp=drafter.vocab_shards(target)).astype(jnp.int32).reshape(b, num_drafts)
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


def phases(*, num_steps: int, simulate_accept_length: float | None = None, verify_steps: int | None = None
           ) -> list[Phase]:
    """num_steps: S = block size - 1 drafts per block. verify_steps: k < S verifies only the block's
    first k drafts (an adaptive variant: k + 1 target tokens per request instead of S + 1); the
    next block is drafted whole either way, so every variant leaves the same state."""
    s = num_steps if verify_steps is None else verify_steps

    def carried(c: SpecStep) -> None:  # the block drafted at the end of the previous step
        c.drafts = c.spec_state["tokens"][c.slots][:, :s]  # [B, k]

    def verify_(c: SpecStep) -> None:
        vt = jnp.concatenate([c.last[:, None], c.drafts], axis=1)
        vbatch = verify.verify_batch(vt, c.l0, c.valid, c.page_table, c.slots, c.page_size)
        out, c.caches = c.target(vbatch, c.caches, capture_layers=c.drafter.capture_layers)
        c.scratch.update(out=out, vbatch=vbatch, logits=out.logits.reshape(c.batch_size, s + 1, -1))

    def accept_(c: SpecStep) -> None:
        accept_chain(c, simulate_accept_length=simulate_accept_length)

    def draft_next(c: SpecStep) -> None:  # context of the verified positions, then the next block
        c.draft_caches = c.drafter.write_context(c.scratch["vbatch"], c.draft_caches,
                                                 c.drafter.target_hidden(c.scratch["out"]))
        drafts, c.draft_caches = draft_block(c.drafter, c.target, c.draft_caches, c.bonus, c.l0 + c.n + 1, c.valid,
                                             c.page_table, c.slots, c.page_size, num_steps)
        c.spec_state = store(c.spec_state, c.slots, c.valid, drafts)

    return [("draft", carried), ("verify", verify_), ("accept", accept_), ("extend", draft_next)]


def make_dflash_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int, rows: SpecRows,
                          simulate_accept_length: float | None = None, verify_steps: int | None = None):
    start = begin(bucket, graphdef, draft_graphdef, page_size=page_size, num_keys=num_steps + 1)
    return compose(start, phases(num_steps=num_steps, simulate_accept_length=simulate_accept_length,
                                 verify_steps=verify_steps), rows)
