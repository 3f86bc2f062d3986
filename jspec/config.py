"""Model configuration parsed from a Hugging Face `config.json`.

One frozen dataclass describes every supported target: dense (Llama, Qwen3), MoE (Qwen3-MoE) and
hybrid Gated-DeltaNet (Qwen3-Next, Qwen3.5). Fields the math does not need are not kept; fields we
cannot honour raise `UnsupportedModelError` naming them, so a checkpoint never runs with silently
wrong numerics.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jspec.errors import UnsupportedModelError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# HF architecture name -> (family, weight prefix of the decoder stack).
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "model."),
    "Qwen3ForCausalLM": ("qwen3", "model."),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "model."),
    "Qwen3NextForCausalLM": ("qwen3_next", "model."),
    "Qwen3_5ForCausalLM": ("qwen3_5", "model."),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "model."),
    # Hub checkpoints of Qwen3.5 are multimodal wrappers; we serve their text model, whose
    # weights sit under `model.language_model.` (vision tower weights are ignored).
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "model.language_model."),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "model.language_model."),
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)

# Families whose RMSNorm scales by (1 + w) and whose attention has a sigmoid output gate.
_ZERO_CENTRED = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
_QK_NORM = {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"}
_HYBRID = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # leading head-dim channels that rotate (partial rotary when < head_dim)
    scaling: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF architecture name
    family: str  # llama | qwen3 | qwen3_moe | qwen3_next | qwen3_5 | qwen3_5_moe
    weight_prefix: str  # "model." or "model.language_model."
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    zero_centred_norm: bool
    qk_norm: bool
    attn_output_gate: bool
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]  # per layer: sparse MoE block instead of the dense MLP
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    gdn_fused_projections: bool = True  # Qwen3-Next: in_proj_qkvz/in_proj_ba; Qwen3.5: split
    # MTP layers stored beside the target (Qwen3-Next / Qwen3.5 `mtp.*`)
    num_mtp_layers: int = 0
    # Tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    raw: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    # --- derived quantities -------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def layer_pattern(self) -> str:
        """Compact layer pattern: A = full attention, G = Gated DeltaNet; lower case = MoE MLP."""
        out = []
        for kind, moe in zip(self.layer_types, self.moe_layers):
            c = "A" if kind == FULL_ATTENTION else "G"
            out.append(c.lower() if moe else c)
        return "".join(out)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _get(cfg: dict, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _require(cfg: dict, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UnsupportedModelError(f"config.json: required field {key!r} is missing")
    return cfg[key]


def _parse_rope(cfg: dict, head_dim: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("config.json: per-layer-type `rope_parameters` are not supported")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    rotary_dim = int(head_dim * float(partial))
    if rotary_dim % 2 or rotary_dim <= 0 or rotary_dim > head_dim:
        raise UnsupportedModelError(
            f"config.json: partial_rotary_factor={partial} gives rotary dim {rotary_dim} for head_dim {head_dim}"
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta), rotary_dim=rotary_dim)
    if rope_type == "llama3":
        try:
            return RopeConfig(
                theta=float(theta),
                rotary_dim=rotary_dim,
                scaling="llama3",
                factor=float(merged["factor"]),
                low_freq_factor=float(merged["low_freq_factor"]),
                high_freq_factor=float(merged["high_freq_factor"]),
                original_max_position_embeddings=int(
                    merged.get(
                        "original_max_position_embeddings",
                        cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)),
                    )
                ),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json: llama3 rope scaling lacks field {e.args[0]!r}") from None
    raise UnsupportedModelError(f"config.json: rope_type {rope_type!r} (rope_scaling/rope_parameters) is not supported")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_hf_config(cfg: dict) -> ModelConfig:
    """Parse a config.json dict into a ModelConfig, raising UnsupportedModelError naming the field."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise UnsupportedModelError("config.json: field 'architectures' is missing or empty")
    arch = archs[0]
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"config.json: architectures={arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    family, prefix = _ARCHITECTURES[arch]
    outer = cfg
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        # Multimodal wrapper: the text model's fields live in text_config; token ids may be outside.
        cfg = {**{k: v for k, v in outer.items() if k != "text_config"}, **cfg["text_config"]}

    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("attention_dropout", 0.0) not in (0, 0.0):
        pass  # inference only: dropout is irrelevant
    if _get(cfg, "pretraining_tp", 1) != 1:
        raise UnsupportedModelError("config.json: pretraining_tp != 1 is not supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("config.json: use_sliding_window=true is not supported")

    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads", heads))
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = int(_get(cfg, "head_dim", hidden // heads))
    n_layers = int(_require(cfg, "num_hidden_layers"))
    rope = _parse_rope(cfg, head_dim)

    # Layer pattern: explicit layer_types, else full_attention_interval for hybrids.
    hybrid = family in _HYBRID
    if hybrid:
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = int(_get(cfg, "full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
    else:
        layer_types = cfg.get("layer_types") or [FULL_ATTENTION] * n_layers
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise UnsupportedModelError(
            f"config.json: layer_types has {len(layer_types)} entries for num_hidden_layers={n_layers}"
        )
    for t in layer_types:
        if t not in (FULL_ATTENTION, LINEAR_ATTENTION) or (t == LINEAR_ATTENTION and not hybrid):
            raise UnsupportedModelError(f"config.json: layer_types entry {t!r} is not supported for {arch}")

    # Which layers carry a sparse MoE block.
    # transformers >= 5 writes Qwen3-MoE's expert count as `num_local_experts`.
    num_experts = int(_get(cfg, "num_experts", _get(cfg, "num_local_experts", 0)))
    if family in ("qwen3_moe", "qwen3_next"):
        step = int(_get(cfg, "decoder_sparse_step", 1))
        mlp_only = set(_get(cfg, "mlp_only_layers", []))
        moe_layers = tuple(
            num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(n_layers)
        )
    elif family == "qwen3_5_moe":
        moe_layers = (True,) * n_layers
    else:
        moe_layers = (False,) * n_layers
    any_moe = any(moe_layers)
    norm_topk = bool(_get(cfg, "norm_topk_prob", family == "qwen3_5_moe"))
    if family == "qwen3_5_moe":
        norm_topk = True  # Qwen3.5-MoE always renormalises the top-k weights
    shared = int(_get(cfg, "shared_expert_intermediate_size", 0)) if family in (
        "qwen3_next", "qwen3_5_moe"
    ) else 0

    if cfg.get("mlp_bias") and family != "llama":
        raise UnsupportedModelError(f"config.json: mlp_bias=true is not supported for {arch}")

    eos = _eos_ids(cfg.get("eos_token_id", outer.get("eos_token_id")))
    mc = ModelConfig(
        architecture=arch,
        family=family,
        weight_prefix=prefix,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(_get(cfg, "intermediate_size", 0)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", outer.get("tie_word_embeddings", False))),
        attention_bias=bool(_get(cfg, "attention_bias", False)),
        mlp_bias=bool(_get(cfg, "mlp_bias", False)),
        rope=rope,
        zero_centred_norm=family in _ZERO_CENTRED,
        qk_norm=family in _QK_NORM,
        attn_output_gate=family in _ZERO_CENTRED,
        layer_types=layer_types,
        moe_layers=moe_layers,
        num_experts=num_experts if any_moe else 0,
        num_experts_per_tok=int(_get(cfg, "num_experts_per_tok", 0)) if any_moe else 0,
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", 0)) if any_moe else 0,
        norm_topk_prob=norm_topk,
        shared_expert_intermediate_size=shared if any_moe else 0,
        linear_num_key_heads=int(_get(cfg, "linear_num_key_heads", 0)) if hybrid else 0,
        linear_num_value_heads=int(_get(cfg, "linear_num_value_heads", 0)) if hybrid else 0,
        linear_key_head_dim=int(_get(cfg, "linear_key_head_dim", 0)) if hybrid else 0,
        linear_value_head_dim=int(_get(cfg, "linear_value_head_dim", 0)) if hybrid else 0,
        linear_conv_kernel_dim=int(_get(cfg, "linear_conv_kernel_dim", 4)) if hybrid else 0,
        gdn_fused_projections=family == "qwen3_next",
        num_mtp_layers=int(_get(cfg, "num_nextn_predict_layers", _get(cfg, "mtp_num_hidden_layers", 0))),
        bos_token_id=cfg.get("bos_token_id", outer.get("bos_token_id")),
        eos_token_ids=eos,
        pad_token_id=cfg.get("pad_token_id", outer.get("pad_token_id")),
        torch_dtype=str(_get(cfg, "dtype", _get(cfg, "torch_dtype", "bfloat16"))),
        raw=dict(outer),
    )
    _validate(mc)
    return mc


def _validate(mc: ModelConfig) -> None:
    if any(mc.moe_layers):
        if mc.num_experts <= 0 or mc.num_experts_per_tok <= 0 or mc.moe_intermediate_size <= 0:
            raise UnsupportedModelError(
                "config.json: MoE layers need num_experts, num_experts_per_tok and moe_intermediate_size > 0"
            )
        if mc.num_experts_per_tok > mc.num_experts:
            raise UnsupportedModelError(
                f"config.json: num_experts_per_tok={mc.num_experts_per_tok} exceeds num_experts={mc.num_experts}"
            )
    if not all(mc.moe_layers) and mc.intermediate_size <= 0:
        raise UnsupportedModelError("config.json: dense layers need intermediate_size > 0")
    if mc.is_hybrid:
        for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            if getattr(mc, f) <= 0:
                raise UnsupportedModelError(f"config.json: hybrid model needs {f} > 0")
        if mc.linear_num_value_heads % mc.linear_num_key_heads:
            raise UnsupportedModelError(
                "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads"
            )
        if mc.linear_conv_kernel_dim < 2:
            raise UnsupportedModelError("config.json: linear_conv_kernel_dim must be >= 2")


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (HF or converted orbax)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise UnsupportedModelError(f"no config.json found at {path!r}")
    with open(file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{file}: not valid JSON ({e})") from None
    return parse_hf_config(cfg)


def generation_eos_token_ids(path: str | os.PathLike) -> set[int]:
    """The end-of-sequence ids a checkpoint's `generation_config.json` adds (empty without one)."""
    f = os.path.join(path, "generation_config.json")
    if not os.path.exists(f):
        return set()
    with open(f) as fh:
        eos = json.load(fh).get("eos_token_id")
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
