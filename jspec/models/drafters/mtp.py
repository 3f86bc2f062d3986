"""MTP (NEXTN) head of Qwen3-Next / Qwen3.5, stored in the target's checkpoint under `mtp.`.

The embedding of the draft token and the hidden are each normalised (zero-centred, like every
norm of these families), concatenated and folded by `fc`, then go through one decoder layer
exactly like the target's full-attention layers (gated attention with q/k norm; MoE with a shared
expert when the target is MoE) and a final norm. The normed output is both what the target's
lm_head reads and the hidden fed back to the next draft step. Embedding and lm_head are the
target's.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jspec.config import FULL_ATTENTION, ModelConfig
from jspec.cache.pool import Caches
from jspec.models.batch import ForwardBatch
from jspec.models.causal_lm import CausalLM, DecoderLayer
from jspec.models.drafters.base import DraftOutput, Drafter, as_dtype
from jspec.models.layers import Linear, RMSNorm
from jspec.models.rope import rope_cos_sin


def mtp_config(target: ModelConfig, *, moe: bool) -> ModelConfig:
    """The target's config cut to the one full-attention MTP layer (so `allocate_caches` gives it
    one KV layer and no Gated-DeltaNet state)."""
    return target.replace(num_hidden_layers=1, layer_types=(FULL_ATTENTION,), moe_layers=(moe,), num_mtp_layers=0)


class MTPDrafter(Drafter):
    kind = "mtp"

    def __init__(self, cfg: ModelConfig, *, dtype):
        e = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norm, dtype=dtype)
        self.config = cfg
        self.capture_layers = ()
        self.draft_vocab_size = cfg.vocab_size
        self.pre_fc_norm_embedding = RMSNorm(e, **norm)
        self.pre_fc_norm_hidden = RMSNorm(e, **norm)
        self.fc = Linear(2 * e, e, bias=False, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, 0, dtype=dtype)])
        self.norm = RMSNorm(e, **norm)

    def __call__(self, batch: ForwardBatch, caches: Caches, hidden, *, target: CausalLM,
                 logits_indices=None, compute_logits: bool = True) -> tuple[DraftOutput, Caches]:
        emb = self.pre_fc_norm_embedding(target.model.embed_tokens(batch.input_ids))  # [T, E]
        hh = self.pre_fc_norm_hidden(as_dtype(hidden, emb))
        x = self.fc(jnp.concatenate([emb, hh], axis=-1))  # [T, 2E] -> [T, E]
        layer = self.layers[0]
        a, kv = layer.self_attn(layer.input_layernorm(x), rope_cos_sin(self.config.rope, batch.positions),
                                caches.kv[0], batch)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        s = self.norm(self._select(x, logits_indices))  # [R, E]
        logits = target.compute_logits(s) if compute_logits else None
        return DraftOutput(logits=logits, hidden=s), self._caches(caches, kv)
