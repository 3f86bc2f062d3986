"""EAGLE (v1 / v2) draft head: `fc([embed(x) | h])` into one Llama decoder layer.

The layer has no input_layernorm (EAGLE drops it on its only layer, so fc's output enters
attention as it is) and the head has no final norm and no lm_head: logits come from the target's
lm_head applied to the layer output, which is also the hidden fed back to the next draft step.
h is the target's final normed hidden, or that previous layer output.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models.attention import Attention
from jspec.cache.pool import Caches
from jspec.models.batch import ForwardBatch
from jspec.models.causal_lm import CausalLM
from jspec.models.drafters.base import DraftOutput, Drafter, as_dtype
from jspec.models.layers import Embedding, Linear, RMSNorm
from jspec.models.mlp import MLP
from jspec.models.rope import rope_cos_sin


class EagleLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        self.self_attn = Attention(cfg, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, zero_centred=False,
                                                dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)


class EagleDrafter(Drafter):
    kind = "eagle"

    def __init__(self, cfg: ModelConfig, *, own_embed: bool, fc_bias: bool, dtype):
        """own_embed: the checkpoint ships `embed_tokens` (else the target's is used); fc_bias:
        EAGLE v1 heads have one."""
        e = cfg.hidden_size
        self.config = cfg
        self.capture_layers = ()
        self.draft_vocab_size = cfg.vocab_size
        self.embed_tokens = Embedding(cfg.vocab_size, e, dtype=dtype) if own_embed else None
        self.fc = Linear(2 * e, e, bias=fc_bias, dtype=dtype)
        self.layers = nnx.List([EagleLayer(cfg, dtype=dtype)])

    def __call__(self, batch: ForwardBatch, caches: Caches, hidden, *, target: CausalLM,
                 logits_indices=None, compute_logits: bool = True) -> tuple[DraftOutput, Caches]:
        emb = self._embed(batch.input_ids, target)  # [T, E]
        z = self.fc(jnp.concatenate([emb, as_dtype(hidden, emb)], axis=-1))  # [T, 2E] -> [T, E]
        layer = self.layers[0]
        a, kv = layer.self_attn(z, rope_cos_sin(self.config.rope, batch.positions), caches.kv[0], batch)
        r = z + a
        out = self._select(r + layer.mlp(layer.post_attention_layernorm(r)), logits_indices)  # [R, E]
        logits = target.compute_logits(out) if compute_logits else None
        return DraftOutput(logits=logits, hidden=out), self._caches(caches, kv)
