"""A speculative engine's plain decode step: no drafts verified, the drafter kept current.

When verifying drafts costs more than it gains (large batches, where a verify forward is
compute-bound, or a low accept length) the engine decodes one token per request instead
(`jspec.runtime.adaptive`). The drafter must still see every accepted token, so that the next
speculative step is exact and drafts as well as if it had never paused:

- EAGLE / EAGLE3 / NEXTN: the drafter extends over the new position with the target's hidden
  state there (`eagle_draft.catch_up` with no drafts), which also refreshes its proposals;
- DFLASH: the drafter's context gets the target's streams at the new position, and the next block
  is drafted from the sampled token;
- STANDALONE: the draft model writes its KV of the request's last token;
- NGRAM: the last token enters the slot's history.

Phases over one `SpecStep` carry (`step_common.py`): verify the single token [last] at L0 (a
one-token verify, so hybrid targets keep their Gated-DeltaNet commit path), accept (n = 0, the
bonus is a plain sample), keep the drafter current. Output rows have the speculative step's layout
(`SpecRows`), so the host reads both the same way.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.runtime.step_inputs import Bucket, SpecRows
from jspec.speculative import dflash_step, ngram, verify
from jspec.speculative.eagle_draft import catch_up
from jspec.speculative.step_common import Phase, SpecStep, accept_chain, begin, compose

KINDS = ("eagle", "dflash", "model", "ngram")  # SpecConfig.draft_kind


def phases(kind: str, *, num_drafts: int) -> list[Phase]:
    """kind: the drafter family (`KINDS`); num_drafts: drafts per block (DFLASH's S)."""
    if kind not in KINDS:
        raise ValueError(f"plain step: unknown drafter kind {kind!r}")

    def before(c: SpecStep) -> None:
        c.drafts = jnp.zeros((c.batch_size, 0), jnp.int32)
        if kind == "model":  # the draft model's KV at L0, as its first draft forward would write it
            batch = verify.decode_batch(c.last, c.l0, c.valid, c.page_table, c.slots, c.page_size)
            _, c.draft_caches = c.drafter(batch, c.draft_caches, compute_logits=False)
        elif kind == "ngram":
            c.spec_state = {"history": ngram.write(c.spec_state["history"], c.page_table, c.valid, c.l0,
                                                   c.last[:, None])}

    def verify_(c: SpecStep) -> None:
        vbatch = verify.verify_batch(c.last[:, None], c.l0, c.valid, c.page_table, c.slots, c.page_size)
        kw = {"capture_layers": c.drafter.capture_layers} if kind in ("eagle", "dflash") else {}
        out, c.caches = c.target(vbatch, c.caches, **kw)
        c.scratch.update(out=out, vbatch=vbatch, logits=out.logits.reshape(c.batch_size, 1, -1))

    def after(c: SpecStep) -> None:
        out = c.scratch["out"]
        if kind == "eagle":
            c.draft_caches, c.spec_state = catch_up(
                c.drafter, c.target, c.draft_caches, c.spec_state, c.drafts, c.n, c.bonus,
                c.drafter.target_hidden(out), c.l0, c.valid, c.page_table, c.slots, c.page_size)
        elif kind == "dflash":
            c.draft_caches = c.drafter.write_context(c.scratch["vbatch"], c.draft_caches, c.drafter.target_hidden(out))
            drafts, c.draft_caches = dflash_step.draft_block(c.drafter, c.target, c.draft_caches, c.bonus, c.l0 + 1,
                                                             c.valid, c.page_table, c.slots, c.page_size, num_drafts)
            c.spec_state = dflash_step.store(c.spec_state, c.slots, c.valid, drafts)

    return [("draft", before), ("verify", verify_), ("accept", accept_chain), ("extend", after)]


def make_plain_spec_step(kind: str, graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, rows: SpecRows,
                         num_keys: int, num_drafts: int = 0):
    """The step for a DECODE bucket with `speculate=False`; rows: the speculative step's output
    layout, which these rows share; num_keys: the speculative step's random uses per request, so
    that both index a request's key stream the same way (a step whose first output has index i
    uses keys i * num_keys + k) and no key is ever drawn twice."""
    start = begin(bucket, graphdef, draft_graphdef, page_size=page_size, num_keys=num_keys)
    # Split for structured output after the target's forward: the masks are filled meanwhile.
    return compose(start, phases(kind, num_drafts=num_drafts), rows, split_after="verify")
