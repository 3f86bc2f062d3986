"""Dense, differentiable forward of `CausalLM` over `ids [B, T]`, for training.

The engine's forward runs through the paged KV cache and the GDN state pool; its reference path
gathers keys per token, which is far too memory-hungry to train through. This one runs each
sequence from position 0 with no cache, on the SAME module and parameters (a trained model loads
into jspec unchanged) and the same per-layer math: the modules' own projection / norm / output
methods (`Attention.project` / `output`, `GatedDeltaNet.project` / `finish`, `SparseMoE.route`),
with only the sequence mixing replaced by its whole-sequence form:
- attention: causal `jax.nn.dot_product_attention` (cuDNN on GPU in bf16, XLA elsewhere);
- Gated DeltaNet: the chunked delta rule and a padded causal conv (`chunked_gdn`);
- MoE: every expert on every token, combined by the router's top-k weights (`SparseMoE.all_experts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models.causal_lm import CausalLM
from jspec.models.mlp import SparseMoE
from jspec.models.rope import rope_cos_sin
from jspec.train.chunked_gdn import causal_conv1d, chunk_gated_delta_rule

ATTENTION_IMPLS = ("auto", "xla", "cudnn")


def _attention_impl(impl: str | None, dtype) -> str:
    if impl in (None, "auto"):
        # cuDNN's fused attention takes half precision only.
        half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if jax.default_backend() == "gpu" and half else "xla"
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLS}, got {impl!r}")
    return impl


def attention(attn, x, cos_sin, *, impl: str | None = None):
    """Causal self-attention of `Attention` module `attn` over x `[B, T, E]` -> `[B, T, E]`."""
    q, k, v, gate = attn.project(x, cos_sin)  # q [B, T, H, D], k / v [B, T, G, D]
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=attn.head_dim ** -0.5,
                                     implementation=_attention_impl(impl, q.dtype))
    return attn.output(o, gate)


def gated_deltanet(gdn, x):
    """`GatedDeltaNet` module `gdn` over x `[B, T, E]` from a zero state -> `[B, T, E]`."""
    mixed, z, b, a = gdn.project(x)
    mixed = causal_conv1d(mixed, gdn.conv_weight())
    q, k, v = gdn.split_heads(mixed)
    g, beta = gdn.gates(b, a)
    core, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    return gdn.finish(core, z, x.dtype)


def feed_forward(mlp, x):
    return mlp.all_experts(x) if isinstance(mlp, SparseMoE) else mlp(x)


def dense_forward(module: CausalLM, ids, *, capture_layers: tuple[int, ...] = (), attention_impl: str | None = None):
    """Full-sequence forward of every row of ids `[B, T]` (positions 0..T-1).

    Returns (logits `[B, T, V]` float32, final_hidden `[B, T, E]` after the final norm, aux
    `[B, T, len(capture_layers), E]` or None). aux means what `ForwardOutput.aux_hidden` means: the
    residual stream entering each captured layer, index `num_hidden_layers` being the un-normed
    output of the last layer (HF's `hidden_states[i]`)."""
    cfg = module.config
    x = module.model.embed_tokens(ids)
    cos_sin = rope_cos_sin(cfg.rope, jnp.arange(ids.shape[1], dtype=jnp.int32))
    captured = {}
    for i, layer in enumerate(module.model.layers):
        if i in capture_layers:
            captured[i] = x
        h = layer.input_layernorm(x)
        if layer.is_attention:
            h = attention(layer.self_attn, h, cos_sin, impl=attention_impl)
        else:
            h = gated_deltanet(layer.linear_attn, h)
        x = x + h
        x = x + feed_forward(layer.mlp, layer.post_attention_layernorm(x))
    if cfg.num_hidden_layers in capture_layers:
        captured[cfg.num_hidden_layers] = x
    final = module.model.norm(x)
    logits = module.compute_logits(final)
    aux = jnp.stack([captured[i] for i in capture_layers], axis=2) if capture_layers else None
    return logits, final, aux
