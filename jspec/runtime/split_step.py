"""A speculative step in two compiled parts, for structured output (`Bucket.grammar_split`).

The draft part runs first; when a grammar-constrained row is in the batch, the host reads the
drafts (the one wait inside a dispatch), walks each constrained row's grammar along them
(`jspec.runtime.grammar.draft_inputs`) and launches the rest of the step with its decisions and
masks. Without constrained rows both parts launch back to back with an all-allowed decision kept
on the device, and the loop never waits. The parts hand over one carry of device arrays
(`jspec.speculative.step_common.carry`); the device state's buffers are donated from one
part to the next.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.runtime import grammar
from jspec.runtime.step_inputs import Bucket


class SplitExecutable:
    """The compiled parts of one bucket's split step, called like a fused step (plus its plan)."""

    def __init__(self, draft, verify, bucket: Bucket, sharding):
        self.draft, self.verify, self.bucket, self.sharding = draft, verify, bucket, sharding
        self._open = None  # the all-allowed decision and masks, on the device

    def open_inputs(self):
        if self._open is None:
            b = self.bucket
            walk_all = grammar.draft_inputs_open(b)
            masks = np.full((b.batch_size, b.grammar_nodes, b.mask_words), -1, np.int32)
            self._open = (jax.device_put(walk_all, self.sharding), jax.device_put(masks, self.sharding))
        return self._open

    def __call__(self, params, state, packed, plan=None):
        buffers, rest, view = self.draft(params, state, packed)
        if plan is not None and grammar.constrained(plan):
            decisions, masks = grammar.draft_inputs(plan, self.bucket, jax.device_get(view))
            decisions, masks = jax.device_put(decisions, self.sharding), jax.device_put(masks, self.sharding)
        else:
            decisions, masks = self.open_inputs()
        return self.verify(params, buffers, rest, decisions, masks)

    def delete(self) -> None:
        for x in self._open or ():
            x.delete()
        self._open = None


def lower(split, bucket: Bucket, params, state, packed, *, out_shardings, sharding):
    """(lowered draft part, lowered verify part) of a `SplitStep` against abstract arguments. One
    device: every carried array lives there (a split target's carry would need the pools' shardings)."""
    draft = jax.jit(split.draft, donate_argnums=(1,))
    lowered_draft = draft.lower(params, state, packed)
    *carry, _ = jax.eval_shape(split.draft, params, state, packed)
    carry = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), carry)
    decisions = jax.ShapeDtypeStruct((bucket.grammar_size,), jnp.int32, sharding=sharding)
    masks = jax.ShapeDtypeStruct((bucket.batch_size, bucket.grammar_nodes, bucket.mask_words), jnp.int32,
                                 sharding=sharding)
    verify = jax.jit(split.verify, donate_argnums=(1,), out_shardings=out_shardings)
    return lowered_draft, verify.lower(params, *carry, decisions, masks)
