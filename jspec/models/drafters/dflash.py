"""DFlash block drafter: one forward drafts a whole block of tokens.

DFlash (z-lab's `DFlashDraftModel`) reads, like EAGLE3, the residual streams of a few target
layers, but it keeps them as *context*: `fc` folds the captured streams of every verified token
`[T, n*E]` to `[T, E]`, `hidden_norm` normalises them, and each draft layer projects that one
context vector to its own K and V (k_norm and RoPE at the token's position; no input norm) and
stores them in the drafter's paged cache. The context never flows through the layers.

A draft block is [the request's newest token, mask x (block_size - 1)] at the next block_size
positions, embedded with the target's embedding. Its queries attend to the whole context and to
every block token, with no causal mask, and the outputs at block rows 1.. go through the target's
lm_head: block_size - 1 drafts from a single forward. The block's own K/V are written to the
cache as well (the kernels read keys from pages); those slots lie past the context and are
overwritten by the context of the tokens that get verified there.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import ops
from jspec.models.attention import Attention
from jspec.cache.pool import Caches
from jspec.models.batch import ForwardBatch
from jspec.models.causal_lm import CausalLM
from jspec.models.drafters.base import DraftOutput, Drafter, as_dtype
from jspec.models.layers import Linear, RMSNorm
from jspec.models.mlp import MLP
from jspec.models.rope import apply_rope, rope_cos_sin


class DFlashLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        e = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.input_layernorm = RMSNorm(e, **norm)
        self.self_attn = Attention(cfg, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(e, **norm)
        self.mlp = MLP(e, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)

    def context_kv(self, c, cos_sin):
        """K, V `[T, G, D]` of context vectors c `[T, E]`: only the K/V rows of qkv_proj are
        multiplied (the context asks no queries)."""
        attn = self.self_attn
        t, g, d = c.shape[0], attn.num_kv_heads, attn.head_dim
        w = attn.qkv_proj.weight[...][attn.q_out:]  # [2 G D, E]
        kv = jnp.einsum("te,oe->to", c, w)
        if attn.qkv_proj.bias is not None:
            kv = kv + attn.qkv_proj.bias[...][attn.q_out:]
        k, v = jnp.split(kv, 2, axis=-1)
        k, v = k.reshape(t, g, d), v.reshape(t, g, d)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        cos, sin = cos_sin
        return apply_rope(k, cos, sin), v


class DFlashDrafter(Drafter):
    kind = "dflash"

    def __init__(self, cfg: ModelConfig, *, capture_layers: tuple[int, ...], block_size: int, mask_token_id: int,
                 dtype):
        """cfg: the draft layers (Qwen3 layers; `num_hidden_layers` of them, each with its own KV
        cache); capture_layers: the target streams read (CausalLM convention: the stream entering
        layer i, i.e. HF's `hidden_states[i]`); block_size: tokens per block as trained."""
        e = cfg.hidden_size
        self.config = cfg
        self.capture_layers = tuple(capture_layers)
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.draft_vocab_size = cfg.vocab_size
        self.fc = Linear(len(self.capture_layers) * e, e, bias=False, dtype=dtype)
        self.hidden_norm = RMSNorm(e, eps=cfg.rms_norm_eps, zero_centred=False, dtype=dtype)
        self.layers = nnx.List([DFlashLayer(cfg, dtype=dtype) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(e, eps=cfg.rms_norm_eps, zero_centred=False, dtype=dtype)

    def write_context(self, batch: ForwardBatch, caches: Caches, hidden) -> Caches:
        """Store the context K/V of the tokens of `batch` (their positions and slots) from the
        target's captured streams `hidden` `[T, n*E]`, in every draft layer's cache."""
        c = self.hidden_norm(self.fc(as_dtype(hidden, self.fc.weight[...])))
        cos_sin = rope_cos_sin(self.config.rope, batch.positions)
        kv = list(caches.kv)
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(c, cos_sin)
            kv[i] = ops.write_kv(kv[i][0], kv[i][1], k, v, batch.slot_mapping)
        return Caches(kv=kv, conv=list(caches.conv), ssm=list(caches.ssm))

    def __call__(self, batch: ForwardBatch, caches: Caches, hidden=None, *, target: CausalLM,
                 logits_indices=None, compute_logits: bool = True) -> tuple[DraftOutput, Caches]:
        """The block forward. batch: B blocks of block_size tokens in "verify" mode with an
        all-true `tree_mask` (no causal mask inside a block; the context before it is always
        visible). `hidden` is unused: the context is already in the caches (`write_context`).
        Returns logits over the target vocabulary for the rows in `logits_indices`."""
        x = target.model.embed_tokens(batch.input_ids)
        cos_sin = rope_cos_sin(self.config.rope, batch.positions)
        kv = list(caches.kv)
        for i, layer in enumerate(self.layers):
            a, kv[i] = layer.self_attn(layer.input_layernorm(x), cos_sin, kv[i], batch)
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        s = self._select(x, logits_indices)
        logits = target.compute_logits(self.norm(s)) if compute_logits else None
        return DraftOutput(logits=logits, hidden=s), Caches(kv=kv, conv=list(caches.conv), ssm=list(caches.ssm))
