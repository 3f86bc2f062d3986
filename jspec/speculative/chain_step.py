"""The speculative decode step of a chain drafter without hidden states: a draft model
(STANDALONE) or n-gram matches in the request's own token history (NGRAM, `ngram.py`).

Phases over one `SpecStep` carry (`step_common.py`):
1. draft: S + 1 decode forwards of the draft model from each request's last token (the last one
   only writes the draft KV of the S-th draft token, so a fully accepted chain leaves the draft
   cache complete); the draft samples from its own filtered distribution q for sampling rows.
   NGRAM instead matches the newest tokens against the slot's token history on the device;
2. verify: one target forward over [last, d1 .. dS] at KV indices L0 .. L0+S (`verify.py`);
3. accept (`accept.py`), then commit the accepted node's Gated-DeltaNet state (hybrid targets);
   NGRAM writes the drafts and the bonus into its history.
KV written for rejected tokens lies past the new length and is overwritten by the next step before
anything reads it (so are the rejected tokens NGRAM writes into its history).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import dispatch
from jspec.runtime import sampler as sampling
from jspec.runtime.step_inputs import Bucket, SpecRows
from jspec.speculative import ngram, verify
from jspec.speculative.step_common import Phase, SpecStep, accept_chain, begin, compose


def phases(*, num_steps: int, simulate_accept_length: float | None = None,
           ngram_windows: tuple[int, int] | None = None) -> list[Phase]:
    """ngram_windows: (min, max) match window of NGRAM, which drafts without a draft model."""
    s = num_steps

    def draft(c: SpecStep) -> None:
        if c.drafter is None:
            # The newest token sits at index l0 of the history: an earlier step sampled it.
            history = ngram.write(c.spec_state["history"], c.page_table, c.valid, c.l0, c.last[:, None])
            c.drafts = ngram.propose(ngram.gather(history, c.page_table), c.l0, s, *ngram_windows)
            c.scratch.update(history=history, q=None)  # point masses at the proposals
            return
        tok, drafts, qs = c.last, [], []
        for k in range(s + 1):
            batch = verify.decode_batch(tok, c.l0 + k, c.valid, c.page_table, c.slots, c.page_size)
            out, c.draft_caches = c.drafter(batch, c.draft_caches, compute_logits=k < s)
            if k < s:
                # The draft model is whole on every device: so are its logits, or XLA splits them
                # over the vocabulary as the split target's beside them, and every argmax and draw
                # here would then gather the devices' partial results.
                logits = dispatch.whole(out.logits)
                q = sampling.filtered_probs(logits, c.sb, sort=c.bucket.sort)  # [B, V]
                drawn = jax.vmap(jax.random.categorical)(c.key_fn(s + 1 + k), jnp.log(q))
                tok = jnp.where(c.greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
                drafts.append(tok)
                qs.append(q)
        c.drafts, c.scratch["q"] = jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1)  # [B, S], [B, S, V]

    def verify_(c: SpecStep) -> None:
        vt = jnp.concatenate([c.last[:, None], c.drafts], axis=1)  # [B, S+1]
        out, c.caches = c.target(verify.verify_batch(vt, c.l0, c.valid, c.page_table, c.slots, c.page_size),
                                 c.caches)
        c.scratch.update(out=out, logits=out.logits.reshape(c.batch_size, s + 1, -1))

    def accept_(c: SpecStep) -> None:
        accept_chain(c, q=c.scratch["q"], simulate_accept_length=simulate_accept_length)
        if c.drafter is None:  # the drafts (those past n are overwritten later), then the bonus
            history = ngram.write(c.scratch["history"], c.page_table, c.valid, c.l0 + 1, c.drafts)
            c.spec_state = {"history": ngram.write(history, c.page_table, c.valid, c.l0 + c.n + 1,
                                                   c.bonus[:, None])}

    return [("draft", draft), ("verify", verify_), ("accept", accept_)]


def make_chain_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int, rows: SpecRows,
                         simulate_accept_length: float | None = None, ngram_windows: tuple[int, int] | None = None,
                         full_steps: int | None = None):
    """draft_graphdef None: NGRAM (params is the target's alone). full_steps: the engine's
    configured chain when this one is shorter (an adaptive variant): keys are counted as the full
    chain's, so no key is drawn twice whichever variant a step runs."""
    full = num_steps if full_steps is None else full_steps
    start = begin(bucket, graphdef, draft_graphdef, page_size=page_size, num_keys=2 * full + 2)
    return compose(start, phases(num_steps=num_steps, simulate_accept_length=simulate_accept_length,
                                 ngram_windows=ngram_windows), rows)
