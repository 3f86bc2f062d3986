"""The speculative decode step of a hidden-state drafter (EAGLE, EAGLE3, NEXTN / MTP), chain (topk 1).

Phases over one `SpecStep` carry (`step_common.py`; the drafter's carried state: `eagle_draft.py`):
1. draft: d1 is carried; S - 1 decode forwards of the drafter at KV indices L0 .. L0+S-2, each
   feeding back its own hidden, give d2 .. dS (top-1, mapped to target ids);
2. verify [last, d1 .. dS] with the target (`verify.py`), capturing the hidden states the drafter
   reads;
3. accept (`accept.py`: greedy, or rejection sampling with point-mass drafts, which is exact
   because the drafter's choice is deterministic) and commit hybrid state;
4. extend the drafter over the S + 1 verified positions with tokens [d1 .. dn, bonus, ...] and the
   target's hidden states: its KV now matches what was accepted, and its output at L0 + n gives
   the next d1 and hidden.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.runtime.step_inputs import Bucket, SpecRows
from jspec.speculative import verify
from jspec.speculative.eagle_draft import catch_up, proposals
from jspec.speculative.step_common import Phase, SpecStep, accept_chain, begin, compose


def phases(*, num_steps: int, simulate_accept_length: float | None = None) -> list[Phase]:
    s = num_steps

    def draft(c: SpecStep) -> None:
        tok, hidden = c.spec_state["tokens"][c.slots, 0], c.spec_state["hidden"][c.slots]
        drafts = [tok]
        for i in range(1, s):
            batch = verify.decode_batch(tok, c.l0 + i - 1, c.valid, c.page_table, c.slots, c.page_size)
            out, c.draft_caches = c.drafter(batch, c.draft_caches, hidden, target=c.target)
            tok = proposals(c.drafter, out, 1, c.target)[0][:, 0]
            hidden = out.hidden
            drafts.append(tok)
        c.drafts = jnp.stack(drafts, axis=1)  # [B, S]

    def verify_(c: SpecStep) -> None:
        vt = jnp.concatenate([c.last[:, None], c.drafts], axis=1)  # [B, S+1]
        vbatch = verify.verify_batch(vt, c.l0, c.valid, c.page_table, c.slots, c.page_size)
        out, c.caches = c.target(vbatch, c.caches, capture_layers=c.drafter.capture_layers)
        c.scratch["out"] = out
        c.scratch["logits"] = out.logits.reshape(c.batch_size, s + 1, -1)

    def accept_(c: SpecStep) -> None:
        accept_chain(c, simulate_accept_length=simulate_accept_length)

    def extend(c: SpecStep) -> None:
        c.draft_caches, c.spec_state = catch_up(
            c.drafter, c.target, c.draft_caches, c.spec_state, c.drafts, c.n, c.bonus,
            c.drafter.target_hidden(c.scratch["out"]), c.l0, c.valid, c.page_table, c.slots, c.page_size)

    return [("draft", draft), ("verify", verify_), ("accept", accept_), ("extend", extend)]


def make_eagle_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int, rows: SpecRows,
                         simulate_accept_length: float | None = None, full_steps: int | None = None):
    """full_steps: the engine's configured chain when this one is shorter (an adaptive variant):
    keys are indexed as the full chain's and rows laid out as its (`rows`), so the host and the key
    stream cannot tell the variants apart."""
    full = num_steps if full_steps is None else full_steps
    start = begin(bucket, graphdef, draft_graphdef, page_size=page_size, num_keys=full + 1)
    return compose(start, phases(num_steps=num_steps, simulate_accept_length=simulate_accept_length), rows)
