"""config.json parsing: every honoured field, and unsupported ones named in the error."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jspec.config import FULL_ATTENTION, LINEAR_ATTENTION, parse_hf_config
from jspec.errors import UnsupportedModelError
from jspec.models.presets import preset_config
from jspec.models.rope import inv_freq

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_defaults_and_gqa():
    c = parse_hf_config(BASE)
    assert c.family == "llama" and c.head_dim == 16 and c.num_key_value_heads == 2
    assert c.rope.theta == 10000.0 and c.rope.rotary_dim == 16 and c.rope.scaling == "default"
    assert not c.tie_word_embeddings and not c.qk_norm and not c.zero_centred_norm
    assert c.layer_pattern() == "AA"


def test_explicit_head_dim_and_rope_locations():
    c = parse_hf_config(dict(BASE, head_dim=32, rope_theta=5e5))
    assert c.head_dim == 32 and c.rope.theta == 5e5 and c.rope.rotary_dim == 32
    c = parse_hf_config(dict(BASE, rope_parameters=dict(rope_type="default", rope_theta=123.0,
                                                        partial_rotary_factor=0.5)))
    assert c.rope.theta == 123.0 and c.rope.rotary_dim == 8
    c = parse_hf_config(dict(BASE, partial_rotary_factor=0.25))
    assert c.rope.rotary_dim == 4


def test_llama3_rope_scaling_matches_formula():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    old = parse_hf_config(dict(BASE, hidden_size=512, num_attention_heads=4, rope_theta=5e5, rope_scaling=scaling))
    new = parse_hf_config(dict(BASE, hidden_size=512, num_attention_heads=4,
                               rope_parameters=dict(scaling, rope_theta=5e5)))
    assert old.rope == new.rope and old.rope.scaling == "llama3"
    inv = inv_freq(new.rope)
    base = 1.0 / (5e5 ** (np.arange(0, 128, 2) / 128))
    wavelen = 2 * math.pi / base
    assert np.allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high frequencies untouched
    assert np.allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8)  # low frequencies scaled down
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert np.all((inv[mid] <= base[mid]) & (inv[mid] >= base[mid] / 8))


def test_qwen3_next_layer_pattern_and_moe():
    c = parse_hf_config(preset_config("qwen3-next-12l"))
    assert c.layer_types[:4] == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert c.attention_layer_ids == (3, 7, 11) and len(c.gdn_layer_ids) == 9
    assert c.zero_centred_norm and c.attn_output_gate and c.qk_norm and c.gdn_fused_projections
    assert c.shared_expert_intermediate_size == 512 and all(c.moe_layers)
    assert c.rope.rotary_dim == 64  # partial_rotary_factor 0.25 of head_dim 256


def test_sparse_step_and_mlp_only_layers():
    cfg = dict(BASE, architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=6, num_local_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])
    c = parse_hf_config(cfg)
    assert c.moe_layers == (False, True, False, False, False, True)
    assert c.num_experts == 4 and not c.norm_topk_prob and c.shared_expert_intermediate_size == 0


def test_explicit_layer_types_and_text_config():
    text = dict(BASE, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"])
    c = parse_hf_config(dict(architectures=["Qwen3_5ForConditionalGeneration"], text_config=text, eos_token_id=[5, 6]))
    assert c.family == "qwen3_5" and c.weight_prefix == "model.language_model."
    assert c.layer_pattern() == "GAG" and not c.gdn_fused_projections and c.eos_token_ids == (5, 6)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
        (dict(architectures=[]), "architectures"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_type"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["full_attention", "linear_attention"]), "layer_types"),
        (dict(partial_rotary_factor=0.1), "partial_rotary_factor"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(hidden_size=None), "hidden_size"),
    ],
)
def test_unsupported_fields_are_named(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        parse_hf_config({**BASE, **change})


def test_hybrid_needs_gdn_fields():
    with pytest.raises(UnsupportedModelError, match="linear_num_key_heads"):
        parse_hf_config(dict(BASE, architectures=["Qwen3NextForCausalLM"], num_experts=0))


@pytest.mark.parametrize("name, billions, tp", [("qwen3-8b", 8.19, 2), ("llama-3.1-70b", 70.6, 4),
                                                ("qwen3-next-80b-a3b", 79.7, 2), ("qwen3.5-397b-a17b", 396.3, 8),
                                                ("qwen3.5-397b-12l", 80.9, 2)])
def test_benchmark_presets_have_their_models_size(name, billions, tp):
    """The random-weight benchmark shapes hold the parameters their names promise (counted from the
    abstract model, nothing allocated), and split the tensor-parallel way their bench stages run them."""
    import jax

    from jspec.models.loader import abstract_model
    from jspec.sharding import check_tp

    config = parse_hf_config(preset_config(name))
    _, state = abstract_model(config, "bfloat16")
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state))
    assert count / 1e9 == pytest.approx(billions, rel=0.01)
    assert check_tp(config, tp, num_devices=tp) == tp
