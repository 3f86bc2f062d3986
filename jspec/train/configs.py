"""HF `config.json` dicts of the tiny model family we train and ship (all on one 8192-token BPE).

Budget: everything shipped (two targets, a standalone draft, an EAGLE3 and a DFlash drafter of
about 2M parameters each) stays under 60 MB in bf16, hence targets of about 8-10M parameters.
"""

from __future__ import annotations

import copy

from jspec.train.data import SPECIAL_TOKENS
from jspec.train.tokenizer import DEFAULT_VOCAB_SIZE, MODEL_MAX_LENGTH

_TOKENS = dict(
    vocab_size=DEFAULT_VOCAB_SIZE,
    bos_token_id=None,
    # An assistant turn ends at <|endoftext|> or where the next user turn would begin.
    eos_token_id=[SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|user|>")],
    pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    max_position_embeddings=MODEL_MAX_LENGTH,
    tie_word_embeddings=True,  # the 8192 x E embedding is a quarter of a target; tying halves it
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
)

CONFIGS = {
    # Qwen3 architecture, 8.4M parameters (6.3M outside the embedding).
    "qwen3": dict(
        _TOKENS, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, intermediate_size=768,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rope_theta=10000.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # Qwen3-Next architecture, 10.1M parameters: 6 Gated DeltaNet + 2 gated-attention layers
    # (GGGA GGGA), every layer a 4-expert top-2 MoE with a shared expert. Carries one MTP layer
    # slot (num_nextn_predict_layers) for the MTP drafter trained later.
    "qwen3-next": dict(
        _TOKENS, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=256,
        intermediate_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=192, shared_expert_intermediate_size=192, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0, output_router_logits=False,
        partial_rotary_factor=0.25, rope_theta=10000.0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        num_nextn_predict_layers=1,
    ),
    # STANDALONE draft model: Qwen3 architecture, 1.4M parameters, same tokenizer as the targets.
    "qwen3-draft": dict(
        _TOKENS, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=128, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        rope_theta=10000.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}


def model_config(name: str, *, vocab_size: int | None = None, **overrides) -> dict:
    """A copy of config `name`; vocab_size follows the tokenizer when given."""
    if name not in CONFIGS:
        raise KeyError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
    cfg = copy.deepcopy(CONFIGS[name])
    if vocab_size is not None:
        cfg["vocab_size"] = int(vocab_size)
    cfg.update(overrides)
    return cfg
