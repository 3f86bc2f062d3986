"""What every hidden-state drafter (EAGLE, EAGLE3, MTP) shares: its output and its interface.

A drafter is one decoder layer that reads, besides the draft token ids, a hidden state: the
target's (at the first draft step and when catching up over verified tokens) or its own previous
output (at later draft steps). It keeps its own paged KV cache (one attention layer), addressed
by the same `ForwardBatch` as the target, and borrows the target's embedding and lm_head where
it has none of its own, so it is called with the merged target module.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jspec.config import ModelConfig
from jspec.cache.pool import Caches
from jspec.models.batch import ForwardBatch
from jspec.models.causal_lm import CausalLM, ForwardOutput


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftOutput:
    """logits `[R, Vd]` float32 over the draft vocabulary (None when not computed); hidden
    `[R, E]`: what the next draft step feeds back (EAGLE: layer output; EAGLE3: pre-norm output;
    MTP: normed output)."""

    logits: jax.Array | None
    hidden: jax.Array


class TokenMap(nnx.Variable):
    """An integer table that travels with the parameters (EAGLE3's d2t) but is not trained."""


class Drafter(nnx.Module):
    kind: str  # "eagle" | "eagle3" | "mtp" | "dflash"
    config: ModelConfig  # the draft layers (one, except DFlash's), all full attention: no GDN layers
    draft_vocab_size: int  # Vd, the width of DraftOutput.logits (< config.vocab_size only for EAGLE3 with d2t)
    # Target layers whose entering residual stream the drafter reads (CausalLM capture_layers);
    # () means it reads the target's final normed hidden instead.
    capture_layers: tuple[int, ...] = ()

    def target_hidden(self, out: ForwardOutput) -> jax.Array:
        """The target's contribution to the drafter input: `[R, n*E]` captured streams, or the
        final normed hidden `[R, E]`."""
        if not self.capture_layers:
            return out.final_hidden
        r, n, e = out.aux_hidden.shape
        return out.aux_hidden.reshape(r, n * e)

    def to_target_ids(self, ids):
        """Draft-vocabulary ids -> target ids (identity unless the draft vocabulary is reduced)."""
        return ids

    def vocab_shards(self, target: CausalLM) -> int:
        """How many ways DraftOutput.logits is split over the vocabulary: the target's split when
        they come from the target's lm_head (a tensor-parallel target's is vocabulary-parallel),
        1 from a head of the drafter's own (replicated, like every drafter weight)."""
        return 1 if getattr(self, "lm_head", None) is not None else target.tp_size

    def __call__(self, batch: ForwardBatch, caches: Caches, hidden, *, target: CausalLM,
                 logits_indices=None, compute_logits: bool = True) -> tuple[DraftOutput, Caches]:
        """The interface every kind implements (eagle.py, eagle3.py, mtp.py); the base has no forward."""
        raise NotImplementedError(f"{type(self).__name__} must define __call__")

    # ---- helpers shared by the kinds ----------------------------------------------------------
    def _embed(self, ids, target: CausalLM):
        own = getattr(self, "embed_tokens", None)
        return (target.model.embed_tokens if own is None else own)(ids)

    @staticmethod
    def _select(x, logits_indices):
        return x if logits_indices is None else x[logits_indices]

    @staticmethod
    def _caches(caches: Caches, kv) -> Caches:
        return Caches(kv=[kv], conv=list(caches.conv), ssm=list(caches.ssm))


def as_dtype(x, like):
    """Cast a fed-in hidden to the drafter's compute dtype (the target may hand over float32)."""
    return x.astype(like.dtype) if x.dtype != like.dtype else x

