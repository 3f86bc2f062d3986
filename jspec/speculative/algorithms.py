"""Each speculative algorithm as the runtime sees it: a `jspec.runtime.step.Drafting`.

The runtime knows nothing of speculation beyond that interface: the engine picks the algorithm here
(`make_drafting`) and hands it to the model runner, which asks it for the per-slot state a drafter
carries, the drafter's part of every prompt chunk and the speculative decode step of each bucket.

- EAGLE, EAGLE3, NEXTN, NAIVE_EAGLE: hidden-state drafters (`eagle_draft.py`), chain
  (`eagle_step.py`) or tree (`tree_step.py`);
- DFLASH: a block drafter (`dflash_step.py`);
- STANDALONE: a smaller model of the same vocabulary, chain (`chain_step.py`);
- NGRAM: drafts matched in the request's own tokens, no weights (`chain_step.py`, `ngram.py`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jspec.runtime.step import ExtendContext
from jspec.runtime.step_inputs import Bucket, SpecRows
from jspec.speculative import dflash_step, eagle_draft, ngram
from jspec.speculative.chain_step import make_chain_spec_step
from jspec.speculative.config import SpecConfig
from jspec.speculative.eagle_step import make_eagle_spec_step
from jspec.speculative.plain_step import make_plain_spec_step
from jspec.speculative.tree_step import make_tree_spec_step


@dataclasses.dataclass
class _Drafting:
    spec: SpecConfig
    target: object  # the loaded target Model
    draft_model: object | None  # a loaded Model (STANDALONE) or DraftModel; None for NGRAM

    @property
    def kv_ahead(self) -> int:
        return self.spec.kv_ahead

    @property
    def prefill_ahead(self) -> int:
        return self.spec.prefill_ahead

    @property
    def max_accept(self) -> int:
        return self.spec.num_steps + 1

    extend_next_ids = False

    @property
    def num_keys(self) -> int:
        """Random uses per request of one speculative step (its `begin(num_keys=...)`): the chain
        step of a draft model or NGRAM samples drafts too, the others only accept."""
        return 2 * self.spec.num_steps + 2 if self.spec.draft_kind in ("model", "ngram") else self.spec.num_steps + 1

    @property
    def shorter_chains(self) -> tuple[int, ...]:
        """Drafts per request (depths) of the shorter variants compiled for adaptivity: a step S
        drafts deep also compiles every depth below S up to S = 4, else 1 and S // 2 (a tree
        variant verifies `tree_nodes(depth)` nodes)."""
        s = self.spec.num_steps
        if s < 2:
            return ()
        return tuple(range(1, s)) if s <= 4 else (1, s // 2)

    def _chain_kw(self, bucket: Bucket, kw: dict) -> dict:
        """A shorter chain variant's step arguments (bucket.draft_steps drafts of the configured chain's)."""
        if bucket.draft_steps:
            kw.update(num_steps=bucket.draft_steps, full_steps=self.spec.num_steps)
        return kw

    def _draft_graphdef(self):
        return None if self.draft_model is None else self.draft_model.graphdef

    def _step_kw(self, page_size: int, num_top: int) -> dict:
        return dict(page_size=page_size, num_steps=self.spec.num_steps, rows=self.rows(num_top),
                    simulate_accept_length=self.spec.simulate_accept_length)

    def grammar_nodes(self, draft_steps: int) -> tuple[int, int]:
        """(nodes, depth) of a speculative step as the grammar sees them (`jspec.runtime.grammar`):
        every verified node, and the deepest one acceptance reaches (draft_steps: a shorter
        variant's depth, 0 the configured one; a chain verifies depth + 1 nodes, a tree
        `tree_nodes(depth)`)."""
        s = draft_steps or self.spec.num_steps
        return (self.tree_nodes(s) if self.spec.topk > 1 else s + 1), s

    def tree_nodes(self, depth: int) -> int:
        """Verified nodes of a tree `depth` deep: the configured num_draft_tokens, or for a
        shallower variant as many as its expansion offers (the root, topk at depth 1, topk^2 at
        each depth below), whichever is fewer."""
        k = self.spec.topk
        return min(self.spec.num_draft_tokens, 1 + k + (depth - 1) * k * k)

    def rows(self, num_top: int) -> SpecRows:
        """The output row layout of every decode step of this engine."""
        return SpecRows(width=self.max_accept, num_top=num_top)

    def target_outputs(self) -> tuple[tuple[int, ...], bool]:
        return (), False

    def init_state(self, layout) -> dict | None:
        return None

    def make_decode_step(self, graphdef, bucket: Bucket, *, page_size: int, num_top_logprobs: int):
        """A DECODE bucket's step: the algorithm's speculative step, or (`bucket.speculate` False)
        the plain step that keeps the drafter current (`plain_step.py`)."""
        if not bucket.speculate:
            return make_plain_spec_step(self.spec.draft_kind, graphdef, self._draft_graphdef(), bucket,
                                        page_size=page_size, rows=self.rows(num_top_logprobs),
                                        num_keys=self.num_keys, num_drafts=self.spec.num_steps)
        return self._speculative_step(graphdef, bucket, **self._step_kw(page_size, num_top_logprobs))


class EagleDrafting(_Drafting):
    """Hidden-state drafters: the drafter extends over every prompt chunk with the tokens shifted
    by one (so extend buckets carry the next token of each token), chains or trees."""

    extend_next_ids = True

    def target_outputs(self):
        return self.draft_model.capture_layers, True

    def init_state(self, layout) -> dict:
        cfg = self.target.config
        return eagle_draft.init_spec_state(layout.num_slots, cfg.hidden_size, self.target.dtype, topk=self.spec.topk)

    def after_extend(self, draft, ctx: ExtendContext, draft_caches, spec_state):
        # -1: the request's newest token, which this step just sampled (or an earlier one did).
        next_ids = ctx.x["next_ids"]
        next_ids = jnp.where(next_ids >= 0, next_ids, ctx.last_token[ctx.tok_slot])
        next_ids = jnp.where(ctx.valid, next_ids, 0)
        return eagle_draft.prefill_draft(draft, ctx.target, draft_caches, ctx.batch, ctx.out, next_ids, ctx.sampled,
                                         ctx.last_idx, spec_state, self.spec.topk)

    def _speculative_step(self, graphdef, bucket: Bucket, **kw):
        kw = self._chain_kw(bucket, kw)
        if self.spec.topk > 1:
            return make_tree_spec_step(graphdef, self._draft_graphdef(), bucket, topk=self.spec.topk,
                                       num_draft_tokens=self.tree_nodes(kw["num_steps"]), **kw)
        return make_eagle_spec_step(graphdef, self._draft_graphdef(), bucket, **kw)


class DFlashDrafting(_Drafting):
    """A block drafter: every prompt chunk writes its context; a finished prompt drafts its first block."""

    def target_outputs(self):
        return self.draft_model.capture_layers, True

    def init_state(self, layout) -> dict:
        return dflash_step.init_spec_state(layout.num_slots, self.spec.num_steps)

    def after_extend(self, draft, ctx: ExtendContext, draft_caches, spec_state):
        return dflash_step.prefill_dflash(draft, ctx.target, draft_caches, ctx.batch, ctx.out, ctx.sampled,
                                          ctx.x["seq_lens"], ctx.tokens, ctx.batch.page_table, spec_state,
                                          ctx.page_size)

    def _speculative_step(self, graphdef, bucket: Bucket, **kw):
        # A shorter variant verifies the block's first draft_steps drafts (the block keeps its size).
        return dflash_step.make_dflash_spec_step(graphdef, self._draft_graphdef(), bucket,
                                                 verify_steps=bucket.draft_steps or None, **kw)


class StandaloneDrafting(_Drafting):
    """A draft model runs over the same tokens, pages and positions as the target, so its KV cache
    tracks the target's."""

    def after_extend(self, draft, ctx: ExtendContext, draft_caches, spec_state):
        _, draft_caches = draft(ctx.batch, draft_caches, logits_indices=ctx.last_idx, compute_logits=False)
        return draft_caches, spec_state

    def _speculative_step(self, graphdef, bucket: Bucket, **kw):
        return make_chain_spec_step(graphdef, self._draft_graphdef(), bucket, **self._chain_kw(bucket, kw))


class NgramDrafting(_Drafting):
    """No weights: the token at every KV position, on the device, in pages beside the KV (so a
    prefix-cache hit brings its history along)."""

    def init_state(self, layout) -> dict:
        return ngram.init_history(layout.num_pages, layout.page_size)

    def after_extend(self, draft, ctx: ExtendContext, draft_caches, spec_state):
        # Every token fed here, at its KV index.
        return draft_caches, {"history": ngram.write_tokens(spec_state["history"], ctx.batch.slot_mapping,
                                                            ctx.batch.input_ids)}

    def _speculative_step(self, graphdef, bucket: Bucket, **kw):
        return make_chain_spec_step(graphdef, None, bucket, ngram_windows=(self.spec.ngram_min_window,
                                                                           self.spec.ngram_max_window),
                                    **self._chain_kw(bucket, kw))


_BY_KIND = {"eagle": EagleDrafting, "dflash": DFlashDrafting, "model": StandaloneDrafting, "ngram": NgramDrafting}


def make_drafting(spec: SpecConfig, target, draft_model) -> _Drafting:
    """The runtime's view of `spec` for a loaded target and drafter (None for NGRAM)."""
    return _BY_KIND[spec.draft_kind](spec=spec, target=target, draft_model=draft_model)
