"""EAGLE3 draft head: a "midlayer" that attends over [embedding | hidden], over a reduced vocabulary.

The target hands over the residual streams entering n of its layers (`capture_layers`), and `fc`
folds their concatenation `[T, n*E]` to `[T, E]`; later draft steps feed back the head's own
pre-norm output `[T, E]` and skip fc (told apart by the static width, as SGLang does). The
midlayer normalises the embedding and the hidden separately and attends over both side by side
(its q/k/v projections are 2E wide), keeping the hidden as the residual. Logits are over the
draft vocabulary Vd; `d2t` maps a draft id to its target id (target = draft + d2t[draft]).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models.attention import Attention
from jspec.cache.pool import Caches
from jspec.models.batch import ForwardBatch
from jspec.models.causal_lm import CausalLM
from jspec.models.drafters.base import DraftOutput, Drafter, TokenMap, as_dtype
from jspec.models.layers import Embedding, Linear, RMSNorm
from jspec.models.mlp import MLP
from jspec.models.rope import rope_cos_sin


class Eagle3Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        e = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.input_layernorm = RMSNorm(e, **norm)  # on the embedding
        self.hidden_norm = RMSNorm(e, **norm)  # on the hidden
        self.self_attn = Attention(cfg, dtype=dtype, in_features=2 * e)
        self.post_attention_layernorm = RMSNorm(e, **norm)
        self.mlp = MLP(e, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)


class Eagle3Drafter(Drafter):
    kind = "eagle3"

    def __init__(self, cfg: ModelConfig, *, capture_layers: tuple[int, ...], draft_vocab_size: int,
                 own_embed: bool, own_head: bool, has_d2t: bool, fc_bias: bool, dtype):
        """own_embed / own_head: the checkpoint ships `embed_tokens` / `lm_head` (else the target's
        are used; a borrowed lm_head needs draft_vocab_size == vocab_size); has_d2t: it ships d2t."""
        e = cfg.hidden_size
        self.config = cfg
        self.capture_layers = tuple(capture_layers)
        self.draft_vocab_size = draft_vocab_size
        self.embed_tokens = Embedding(cfg.vocab_size, e, dtype=dtype) if own_embed else None
        self.fc = Linear(len(self.capture_layers) * e, e, bias=fc_bias, dtype=dtype)
        self.midlayer = Eagle3Layer(cfg, dtype=dtype)
        self.norm = RMSNorm(e, eps=cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.lm_head = Linear(e, draft_vocab_size, bias=False, dtype=dtype) if own_head else None
        self.d2t = TokenMap(jnp.zeros((draft_vocab_size,), jnp.int32)) if has_d2t else None

    def to_target_ids(self, ids):
        if self.d2t is None:
            return ids
        return ids + jnp.take(self.d2t[...], ids, axis=0).astype(ids.dtype)

    def __call__(self, batch: ForwardBatch, caches: Caches, hidden, *, target: CausalLM,
                 logits_indices=None, compute_logits: bool = True) -> tuple[DraftOutput, Caches]:
        emb = self._embed(batch.input_ids, target)  # [T, E]
        h = as_dtype(hidden, emb)
        if h.shape[-1] != emb.shape[-1]:
            h = self.fc(h)  # target streams [T, n*E] -> [T, E]
        layer = self.midlayer
        x = jnp.concatenate([layer.input_layernorm(emb), layer.hidden_norm(h)], axis=-1)  # [T, 2E]
        a, kv = layer.self_attn(x, rope_cos_sin(self.config.rope, batch.positions), caches.kv[0], batch)
        r = h + a
        s = self._select(r + layer.mlp(layer.post_attention_layernorm(r)), logits_indices)  # [R, E]
        logits = None
        if compute_logits:
            normed = self.norm(s)
            if self.lm_head is None:
                logits = target.compute_logits(normed)  # [R, V]: borrowed head, Vd == V
            else:
                logits = self.lm_head(normed).astype(jnp.float32)  # [R, Vd]
        return DraftOutput(logits=logits, hidden=s), self._caches(caches, kv)
