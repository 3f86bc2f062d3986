"""A grammar engine's decode step in two compiled parts (`Bucket.grammar_split`), so that the host
work a constrained row needs overlaps the device.

- Speculative (`jspec.speculative.step_common.SplitStep`): the draft part runs first; the host
  reads the drafts, walks each constrained row's grammar along them
  (`jspec.runtime.grammar.draft_inputs`) and launches the rest with its decisions and masks. The
  parts hand over one carry of device arrays (`jspec.speculative.step_common.carry`).
- Plain decode (`jspec.runtime.step.SplitSample`): the forward runs first; the sampling half takes
  the masks (`jspec.runtime.grammar.step_inputs`). A speculative engine's plain step
  (`jspec.speculative.plain_step`) splits the same way, after its target forward, as a
  `SplitStep` with no drafts (the host walks each constrained row's root only).

With overlap, the loop launches the first part before it reads the previous step, whose tokens
the grammars must consume before they can answer (`ModelRunner.dispatch`'s `between`), so the
device computes while the host reads results and fills masks. The device state's buffers are
donated from one part to the next.

A batch without constrained rows runs the bucket's fused step instead (compiled beside the parts,
the same step without grammar inputs): two launches and the carry between them cost a small batch
a visible share of its step (bench/README.md, "Structured output"), and a grammar engine mostly
serves unconstrained requests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec.runtime import grammar
from jspec.runtime.step import SplitSample
from jspec.runtime.step_inputs import Bucket
from jspec.sharding import TP


class SplitExecutable:
    """The compiled parts of one bucket's split step (first, second) and its fused twin."""

    def __init__(self, first, second, fused, bucket: Bucket, sharding, *, plain: bool):
        """plain: a plain engine's step (a SplitSample: the carry is the state and the logits);
        else a speculative engine's (`step_common.SplitStep`, its plain steps included)."""
        self.first, self.second, self.fused = first, second, fused
        self.bucket, self.sharding = bucket, sharding
        self.plain = plain

    def begin(self, params, state, packed):
        """Launch the first part (it needs nothing from the host) -> its carry."""
        return self.first(params, state, packed)

    def complete(self, params, packed, carry, plan):
        """Fill the plan's grammar inputs now (the grammars have consumed every earlier token) and
        launch the second part -> (state, out)."""
        b = self.bucket
        if self.plain:
            state, logits = carry
            return self.second(params, state, packed, logits, self._put(grammar.step_inputs(plan, b)))
        buffers, rest, view = carry
        # Named in profiler traces: the host's wait for the drafts, then its walk over them.
        with jax.profiler.TraceAnnotation("jspec.wait_drafts"):
            view = jax.device_get(view)
        with jax.profiler.TraceAnnotation("jspec.grammar_walk"):
            decisions, masks = grammar.draft_inputs(plan, b, view)
        return self.second(params, buffers, rest, jax.device_put(decisions, self.sharding), self._put(masks))

    def _put(self, masks):
        """Masks on the device; all allowed where every constrained row finished meanwhile."""
        if masks is None:
            b = self.bucket
            masks = np.full((b.batch_size, b.grammar_nodes, b.mask_words), -1, np.int32)
        return jax.device_put(masks, self.sharding)

    def __call__(self, params, state, packed, plan=None):
        """(state, out) of the step; plan None (start-up timing) or without constrained rows: the fused step."""
        if plan is None or not grammar.constrained(plan):
            return self.fused(params, state, packed)
        return self.complete(params, packed, self.begin(params, state, packed), plan)


def without_grammar(bucket: Bucket) -> Bucket:
    """The bucket's fused twin: the same step with no grammar inputs."""
    return dataclasses.replace(bucket, grammar_nodes=0, mask_words=0, grammar_split=False, grammar_depth=0)


def lower(split, fused, bucket: Bucket, params, state, packed, *, out_shardings, sharding, tp: int = 1):
    """(lowered first part, lowered second part, lowered fused step) of a split step and its fused
    twin's step function against abstract arguments. The carry keeps each array's place: the
    state's buffers as the device state holds them (a split target's pools split), a plain step's
    logits split by vocabulary as the forward leaves them (when the vocabulary divides by tp),
    everything else replicated: small for a speculative step's drafts; a speculative engine's plain
    step also carries its target forward's output, which a split target then gathers between the
    parts (correct, a cost only at tp > 1)."""
    masks = jax.ShapeDtypeStruct((bucket.batch_size, bucket.grammar_nodes, bucket.mask_words), jnp.int32,
                                 sharding=sharding)
    lowered_fused = jax.jit(fused, donate_argnums=(1,), out_shardings=out_shardings).lower(params, state, packed)
    state_sh = out_shardings[0]
    if isinstance(split, SplitSample):
        _, logits = jax.eval_shape(split.forward, params, state, packed)
        vocab = NamedSharding(sharding.mesh, P(None, TP)) if logits.shape[-1] % tp == 0 else sharding
        forward = jax.jit(split.forward, donate_argnums=(1,), out_shardings=(state_sh, vocab))
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=vocab)
        sample = jax.jit(split.sample, donate_argnums=(1,), out_shardings=out_shardings)
        return forward.lower(params, state, packed), sample.lower(params, state, packed, logits, masks), lowered_fused
    buffers, rest, view = jax.eval_shape(split.draft, params, state, packed)
    pools = ("caches", "draft_caches", "spec_state")  # the buffers travel as the device state holds them
    buffer_sh = {k: getattr(state_sh, k) if k in pools else dataclasses.replace(state_sh, **{p: None for p in pools})
                 for k in buffers}
    rest_sh = jax.tree.map(lambda _: sharding, rest)
    draft = jax.jit(split.draft, donate_argnums=(1,), out_shardings=(buffer_sh, rest_sh, sharding))
    lowered_draft = draft.lower(params, state, packed)
    place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    buffers, rest = jax.tree.map(place, buffers, buffer_sh), jax.tree.map(place, rest, rest_sh)
    decisions = jax.ShapeDtypeStruct((bucket.grammar_size,), jnp.int32, sharding=sharding)
    verify = jax.jit(split.verify, donate_argnums=(1,), out_shardings=out_shardings)
    return lowered_draft, verify.lower(params, buffers, rest, decisions, masks), lowered_fused
