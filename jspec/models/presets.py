"""Model shapes as HF `config.json` dicts: tiny ones for demos and CI, real ones for benchmarks.

Benchmarks need the shapes of real models (Qwen3-8B, Qwen3-Next) without their weights; a preset
plus `write_random_checkpoint` gives an HF-format directory that jspec and transformers both read.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

_TINY_COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
                    bos_token_id=1, eos_token_id=2)

PRESETS = {
    "tiny-llama": dict(_TINY_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2,
                       rope_theta=10000.0, tie_word_embeddings=False),
    "tiny-qwen3": dict(_TINY_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=2,
                       rope_theta=1000000.0, tie_word_embeddings=True),
    "tiny-qwen3-moe": dict(_TINY_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                           num_hidden_layers=2, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False),
    "tiny-qwen3-next": dict(_TINY_COMMON, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                            num_hidden_layers=4, full_attention_interval=4, head_dim=32, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                            norm_topk_prob=True, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                            rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                 partial_rotary_factor=0.25),
                            tie_word_embeddings=False),
    # Real shapes (random weights) for GPU benchmarks.
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     hidden_act="silu", tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # Qwen3-Next-80B-A3B with the layer count cut to 12 (3 GDN : 1 attention) to fit one GPU.
    "qwen3-next-12l": dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936,
                           hidden_size=2048, intermediate_size=5120, num_hidden_layers=12, num_attention_heads=16,
                           num_key_value_heads=2, head_dim=256, max_position_embeddings=262144, rms_norm_eps=1e-6,
                           hidden_act="silu", full_attention_interval=4, num_experts=512, num_experts_per_tok=10,
                           moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=16,
                           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_conv_kernel_dim=4,
                           rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                partial_rotary_factor=0.25),
                           tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # Llama-3.1-70B (140 GB of bf16 weights: tensor parallelism over at least 2 x H200).
    "llama-3.1-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
                          rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                 high_freq_factor=4.0,
                                                                 original_max_position_embeddings=8192),
                          tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
}
# Qwen3-Next-80B-A3B: the 12-layer preset at its full depth (48 layers, 160 GB of bf16 weights).
PRESETS["qwen3-next-80b-a3b"] = dict(PRESETS["qwen3-next-12l"], num_hidden_layers=48)
# Qwen3.5-397B-A17B (hybrid, 512 experts, split GDN projections): dimensions that give its 397B
# total / 17B active parameters; random weights, so only the shape matters.
PRESETS["qwen3.5-397b-a17b"] = dict(
    architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe", vocab_size=248320, hidden_size=4096,
    num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256, max_position_embeddings=262144,
    rms_norm_eps=1e-6, hidden_act="silu", full_attention_interval=4, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024, norm_topk_prob=True,
    linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
    tie_word_embeddings=False, bos_token_id=248044, eos_token_id=248046)
# The same with its depth cut to 12 layers (3 GDN : 1 attention kept; 161 GB of bf16 weights): its
# layers at tensor parallelism on machines that cannot hold all 60 (2 x H200).
PRESETS["qwen3.5-397b-12l"] = dict(PRESETS["qwen3.5-397b-a17b"], num_hidden_layers=12)


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return json.loads(json.dumps(PRESETS[name]))


def fused_split_sizes(config, name: str) -> list[int] | None:
    """Row counts of the HF projections that a fused jspec parameter concatenates."""
    if ".self_attn.qkv_proj." in name:
        q = config.num_attention_heads * config.head_dim * (2 if config.attn_output_gate else 1)
        kv = config.num_key_value_heads * config.head_dim
        return [q, kv, kv]
    if name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
        inter = config.shared_expert_intermediate_size if ".shared_expert." in name else config.intermediate_size
        return [inter, inter]
    return None


def write_random_checkpoint(out_dir: str, preset: str, *, seed: int = 0, dtype: str = "float32") -> str:
    """Write `config.json` + `model.safetensors` with random weights in HF names and layouts."""
    from safetensors.numpy import save_file

    from checkpoints.hf_mapping import to_hf_tensors

    from jspec.config import parse_hf_config
    from jspec.models.loader import random_model, state_to_flat

    cfg_dict = preset_config(preset)
    cfg_dict["torch_dtype"] = dtype
    config = parse_hf_config(cfg_dict)
    model = random_model(config, dtype="float32", seed=seed, scale=0.05)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    flat = {}
    for k, v in state_to_flat(model.params).items():
        flat.update(to_hf_tensors(k, np.asarray(v).astype(np_dtype), fused_split_sizes(config, k)))
    os.makedirs(out_dir, exist_ok=True)
    save_file(flat, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    return out_dir
