"""A speculative step in two compiled parts, for structured output (`Bucket.grammar_split`).

The draft part runs first; when a grammar-constrained row is in the batch, the host reads the
drafts (the one wait inside a dispatch), walks each constrained row's grammar along them
(`jspec.runtime.grammar.draft_inputs`) and launches the rest of the step with its decisions and
masks. The parts hand over one carry of device arrays (`jspec.speculative.step_common.carry`);
the device state's buffers are donated from one part to the next.

A batch without constrained rows runs the bucket's fused step instead (compiled beside the parts,
the same step without grammar inputs): two launches and the carry between them cost a small
batch a visible share of its step (bench/README.md, "Structured output"), and a grammar engine
mostly serves unconstrained requests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.runtime import grammar
from jspec.runtime.step_inputs import Bucket


class SplitExecutable:
    """The compiled parts of one bucket's split step, called like a fused step (plus its plan)."""

    def __init__(self, draft, verify, fused, bucket: Bucket, sharding):
        self.draft, self.verify, self.fused = draft, verify, fused
        self.bucket, self.sharding = bucket, sharding

    def __call__(self, params, state, packed, plan=None):
        """(state, out) of the step; plan None (start-up timing) or without constrained rows: the fused step."""
        if plan is None or not grammar.constrained(plan):
            return self.fused(params, state, packed)
        buffers, rest, view = self.draft(params, state, packed)
        decisions, masks = grammar.draft_inputs(plan, self.bucket, jax.device_get(view))
        decisions, masks = jax.device_put(decisions, self.sharding), jax.device_put(masks, self.sharding)
        return self.verify(params, buffers, rest, decisions, masks)


def without_grammar(bucket: Bucket) -> Bucket:
    """The bucket's fused twin: the same step with no grammar inputs."""
    return dataclasses.replace(bucket, grammar_nodes=0, mask_words=0, grammar_split=False, grammar_depth=0)


def lower(split, fused, bucket: Bucket, params, state, packed, *, out_shardings, sharding):
    """(lowered draft part, lowered verify part, lowered fused step) of a `SplitStep` and its fused
    twin's step function against abstract arguments. One device: every carried array lives there
    (a split target's carry would need the pools' shardings)."""
    draft = jax.jit(split.draft, donate_argnums=(1,))
    lowered_draft = draft.lower(params, state, packed)
    *carry, _ = jax.eval_shape(split.draft, params, state, packed)
    carry = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), carry)
    decisions = jax.ShapeDtypeStruct((bucket.grammar_size,), jnp.int32, sharding=sharding)
    masks = jax.ShapeDtypeStruct((bucket.batch_size, bucket.grammar_nodes, bucket.mask_words), jnp.int32,
                                 sharding=sharding)
    verify = jax.jit(split.verify, donate_argnums=(1,), out_shardings=out_shardings)
    lowered_fused = jax.jit(fused, donate_argnums=(1,), out_shardings=out_shardings).lower(params, state, packed)
    return lowered_draft, verify.lower(params, *carry, decisions, masks), lowered_fused
