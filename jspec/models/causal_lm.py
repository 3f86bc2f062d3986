"""Decoder-only causal LM covering every supported target family.

One class, configured by `ModelConfig`: per layer a token mixer (paged attention or Gated
DeltaNet) and a feed-forward block (SwiGLU or sparse MoE). Parameter paths equal Hugging Face names
(`model.layers.3.self_attn.o_proj.weight`), except that q/k/v and gate/up projections are fused
(`qkv_proj`, `gate_up_proj`) and MoE experts are stacked; `checkpoints/hf_mapping.py` does both at load.

`CausalLM.__call__` is pure apart from returning new caches: it is traced once per bucket inside
a jitted step (after `nnx.split`), never run eagerly in the engine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import FULL_ATTENTION, ModelConfig
from jspec.models.attention import Attention
from jspec.cache.pool import Caches
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.models import ops
from jspec.models.gdn import GatedDeltaNet
from jspec.models.layers import Embedding, Linear, RMSNorm
from jspec.models.mlp import MLP, SparseMoE
from jspec.models.rope import rope_cos_sin
from jspec.sharding import mixer_tp, padded_vocab


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, *, dtype, tp_size: int = 1, expert_parallel: bool = False,
                 replicate_attention: bool = False):
        mixer_tp_size = mixer_tp(tp_size, replicate_attention)
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norm, dtype=dtype)
        self.is_attention = cfg.layer_types[layer_id] == FULL_ATTENTION
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        if self.is_attention:
            self.self_attn = Attention(cfg, dtype=dtype, tp_size=mixer_tp_size)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, tp_size=mixer_tp_size)
        if cfg.moe_layers[layer_id]:
            self.mlp = SparseMoE(cfg, dtype=dtype, tp_size=tp_size, expert_parallel=expert_parallel)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, tp_size=tp_size)


class DecoderStack(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, tp_size: int = 1, expert_parallel: bool = False,
                 replicate_attention: bool = False):
        self.embed_tokens = Embedding(padded_vocab(cfg.vocab_size, tp_size), cfg.hidden_size, dtype=dtype,
                                      tp_size=tp_size)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, tp_size=tp_size, expert_parallel=expert_parallel,
                                             replicate_attention=replicate_attention)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norm, dtype=dtype)


@dataclasses.dataclass
class ForwardOutput:
    """logits `[R, V]` float32 for the selected rows; final_hidden `[R, E]` (after the final norm);
    aux_hidden `[R, len(capture), E]`: the residual stream entering each captured layer (index
    `num_layers` is the un-normed output of the last layer), as HF's `output_hidden_states[i]`.
    With `all_hidden`, final_hidden and aux_hidden keep all T rows. gdn_scratch (verify mode):
    per GDN layer (conv window after every draft token, the tokens' (k, v, g, beta) to replay), for
    `ops.gdn_commit`."""

    logits: jax.Array | None
    final_hidden: jax.Array
    aux_hidden: jax.Array | None
    gdn_scratch: list | None = None


jax.tree_util.register_dataclass(ForwardOutput, data_fields=["logits", "final_hidden", "aux_hidden", "gdn_scratch"],
                                 meta_fields=[])


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, tp_size: int = 1, expert_parallel: bool = False,
                 replicate_attention: bool = False):
        """tp_size: the layout of a target split over that many devices (`jspec.sharding`):
        heads and intermediate dimensions are cut tp ways, the vocabulary padded to a multiple of it;
        expert_parallel: MoE experts split whole instead; replicate_attention: the token mixers
        (attention, Gated DeltaNet) whole on every device."""
        self.config = cfg
        self.tp_size = tp_size
        self.mixer_tp_size = mixer_tp(tp_size, replicate_attention)  # what the KV / state pools split with
        self.model = DecoderStack(cfg, dtype=dtype, tp_size=tp_size, expert_parallel=expert_parallel,
                                  replicate_attention=replicate_attention)
        vocab = padded_vocab(cfg.vocab_size, tp_size)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab, bias=False, dtype=dtype)

    def _add_norm(self, x, delta, norm: RMSNorm):
        """(x + delta, norm(x + delta)) in one kernel where there is one."""
        return ops.add_rms_norm(x, delta, norm.weight[...], eps=norm.eps, zero_centred=norm.zero_centred,
                                tp=self.tp_size)

    def compute_logits(self, hidden):
        """`[..., E]` -> float32 logits `[..., V]` (the columns of a padded vocabulary dropped)."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        return logits.astype(jnp.float32)

    def __call__(
        self,
        batch: ForwardBatch,
        caches: Caches,
        *,
        logits_indices=None,
        capture_layers: tuple[int, ...] = (),
        compute_logits: bool = True,
        input_embeds=None,
        all_hidden: bool = False,
    ) -> tuple[ForwardOutput, Caches]:
        """Run the stack over the step's T tokens.

        logits_indices `[R]`: rows whose outputs are wanted (e.g. each request's last token); None
        keeps all T. input_embeds `[T, E]` replaces the token embedding (drafters feed their own).
        all_hidden: hidden states of all T rows even when logits are wanted for a few (a drafter
        extends over every token of a prefill chunk).
        """
        cfg = self.config
        x = self.model.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        cos_sin = rope_cos_sin(cfg.rope, batch.positions)
        kv, conv, ssm = list(caches.kv), list(caches.conv), list(caches.ssm)
        captured = {}
        scratch = [] if batch.mode is ForwardMode.VERIFY else None
        attn_i = gdn_i = 0
        delta = None  # the last MLP's output, added to x together with the next norm (ops.add_rms_norm)
        for i, layer in enumerate(self.model.layers):
            x, h = self._add_norm(x, delta, layer.input_layernorm)
            if i in capture_layers:
                captured[i] = x
            if layer.is_attention:
                h, kv[attn_i] = layer.self_attn(h, cos_sin, kv[attn_i], batch)
                attn_i += 1
            else:
                h, c, st = layer.linear_attn(h, conv[gdn_i], ssm[gdn_i], batch)
                if scratch is not None:
                    scratch.append((c, st))  # the pools stay as they are until commit
                else:
                    conv[gdn_i], ssm[gdn_i] = c, st
                gdn_i += 1
            x, h = self._add_norm(x, h, layer.post_attention_layernorm)
            delta = layer.mlp(h)
        x = x + delta
        if cfg.num_hidden_layers in capture_layers:
            captured[cfg.num_hidden_layers] = x

        final = self.model.norm(x if all_hidden or logits_indices is None else x[logits_indices])
        if all_hidden:
            logits_in = final if logits_indices is None else final[logits_indices]
        else:
            logits_in = final
            if logits_indices is not None:
                captured = {k: v[logits_indices] for k, v in captured.items()}
        logits = self.compute_logits(logits_in) if compute_logits else None
        aux = jnp.stack([captured[i] for i in capture_layers], axis=1) if capture_layers else None
        return (ForwardOutput(logits=logits, final_hidden=final, aux_hidden=aux, gdn_scratch=scratch),
                Caches(kv=kv, conv=conv, ssm=ssm))
