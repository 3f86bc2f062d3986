"""Read a DFlash draft checkpoint (z-lab's format) or make one with random weights.

Format: config.json of a Qwen3 model with architectures ["DFlashDraftModel"], `block_size`,
`num_target_layers` and `dflash_config` = {mask_token_id, target_layer_ids}; tensors `fc`,
`hidden_norm`, `layers.N.*` (Qwen3 decoder layers), `norm`, without the `model.` prefix. It has no
embedding and no lm_head: the target's are used.

`target_layer_ids` name target layers whose *output* is read (HF's `hidden_states[i + 1]`), which
is the stream entering layer i + 1 in jspec's capture convention.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jspec.config import FULL_ATTENTION, ModelConfig, RopeConfig, parse_hf_config
from jspec.errors import CheckpointError, ConfigError, UnsupportedModelError
from jspec.models.drafters.dflash import DFlashDrafter
from jspec.models.drafters.reader import (DraftModel, build_draft_model, checkpoint_storage, head_tensors,
                                          random_params, read_config_json, read_params)
from jspec.models.loader import Model

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default when config.json names none: one layer in the middle for a one-layer
    drafter, else num_draft_layers ids spread evenly over layers 1 .. L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ----------------------------------------------------------------------------- config.json


def dflash_block(raw: dict) -> int:
    """The block size of a DFlash config.json `raw` (`dflash_config.block_size`, else the
    top-level `block_size`), after the architecture check: the part of `dflash_config` that
    needs no target."""
    arch = (raw.get("architectures") or [None])[0]
    if arch not in DFLASH_ARCHITECTURES:
        raise UnsupportedModelError(f"draft config.json: architectures={arch!r} is not a DFlash drafter "
                                    f"(expected one of {', '.join(DFLASH_ARCHITECTURES)})")
    extra = raw.get("dflash_config") or {}
    block = extra.get("block_size", raw.get("block_size"))
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise ConfigError(f"draft config.json: block_size={block!r} must be an int >= 2")
    return block


def dflash_config(raw: dict, target: ModelConfig) -> tuple[ModelConfig, tuple[int, ...], int, int]:
    """(draft layers' config, capture layers, block_size, mask_token_id) of a DFlash config.json,
    checked against the target."""
    block = dflash_block(raw)
    arch = raw["architectures"][0]
    extra = raw.get("dflash_config") or {}
    mask = extra.get("mask_token_id", raw.get("mask_token_id"))
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise ConfigError(f"draft config.json: dflash_config.mask_token_id={mask!r} must be a token id of the "
                          f"target's vocabulary [0, {target.vocab_size})")
    n_target = target.num_hidden_layers
    if raw.get("num_target_layers") not in (None, n_target):
        raise ConfigError(f"draft config.json: num_target_layers={raw['num_target_layers']} but the target has "
                          f"{n_target} layers")
    layers = int(raw.get("num_hidden_layers", 1))
    ids = extra.get("target_layer_ids") or default_target_layer_ids(n_target, layers)
    # The last layer's output is HF's final *normed* hidden state, which CausalLM does not capture.
    if len(set(ids)) != len(ids) or any(not 0 <= int(i) < n_target - 1 for i in ids):
        raise ConfigError(f"draft config.json: dflash_config.target_layer_ids={list(ids)} must be distinct layer "
                          f"ids in [0, {n_target - 2}] of the {n_target}-layer target")
    capture = tuple(int(i) + 1 for i in ids)  # kept in config order: fc was trained on that order

    plain = {k: v for k, v in raw.items() if k not in ("layer_types", "dflash_config")}
    cfg = parse_hf_config({**plain, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                           "num_hidden_layers": layers, "vocab_size": raw.get("vocab_size", target.vocab_size)})
    cfg = cfg.replace(architecture=arch, weight_prefix="")
    if cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"draft config.json: hidden_size={cfg.hidden_size} must equal the target's hidden_size="
                          f"{target.hidden_size} (the block is embedded with the target's embedding)")
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocab_size={cfg.vocab_size} must equal the target's vocab_size={target.vocab_size}")
    return cfg, capture, block, mask


def dflash_block_size(path) -> int | None:
    """The block size a DFlash drafter at `path` was trained with (the engine's default number of
    draft tokens), from its config.json alone, before any weight is read.

    None when `path` has no readable config.json (absent, unreadable or not JSON): the loader
    then reports that problem with its own message. A readable config.json that is not a DFlash
    one, or whose block size is not an int >= 2, raises the loader's error for it.
    """
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return dflash_block(raw)


def dflash_drafter_config(path: str, target: ModelConfig) -> ModelConfig:
    """The draft layers' config of the DFlash directory `path`, with every check `load_dflash`
    makes before it reads tensors, in the same order, so the same error."""
    cfg = dflash_config(read_config_json(path), target)[0]
    checkpoint_storage(path)
    return cfg


# ----------------------------------------------------------------------------- loading


def load_dflash(path: str, target: Model, dt) -> DraftModel:
    """The DFlash drafter at `path`, in dtype `dt`."""
    cfg, capture, block, mask = dflash_config(read_config_json(path), target.config)
    # Some exports carry a copy of the target's embedding / head; DFlash uses the target's.
    view = head_tensors(path, drop=("embed_tokens.weight", "lm_head.weight"))
    e = cfg.hidden_size
    if "fc.weight" in view and view.shape("fc.weight") != (e, len(capture) * e):
        raise CheckpointError(f"shape {view.shape('fc.weight')}: fc reads {len(capture)} target layers x hidden_size "
                              f"{e}, so it must be ({e}, {len(capture) * e})", tensor=view.stored("fc.weight"))
    return build_draft_model("dflash", lambda: DFlashDrafter(cfg, capture_layers=capture, block_size=block,
                                                             mask_token_id=mask, dtype=dt),
                             lambda exp: read_params(view, exp, dt), dt, path)


# ----------------------------------------------------------------------------- random weights


def random_config(target: ModelConfig, *, num_layers: int = 5, intermediate_size=None, num_attention_heads=None,
                  num_key_value_heads=None, head_dim=None) -> ModelConfig:
    """Qwen3 draft layers shaped after the target (z-lab's Qwen3-8B drafter has 5 of them)."""
    head_dim = head_dim or target.head_dim
    inter = intermediate_size or target.intermediate_size
    if inter <= 0:
        raise ConfigError("random DFlash drafter: the target has no dense intermediate_size; pass intermediate_size=")
    rope = target.rope
    if rope.rotary_dim != head_dim:
        rope = RopeConfig(theta=rope.theta, rotary_dim=head_dim)
    return ModelConfig(
        architecture="DFlashDraftModel", family="qwen3", weight_prefix="", vocab_size=target.vocab_size,
        hidden_size=target.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads or target.num_attention_heads,
        num_key_value_heads=num_key_value_heads or target.num_key_value_heads, head_dim=head_dim,
        intermediate_size=inter, rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, rope=rope, zero_centred_norm=False, qk_norm=True, attn_output_gate=False,
        layer_types=(FULL_ATTENTION,) * num_layers, moe_layers=(False,) * num_layers, torch_dtype=target.torch_dtype,
    )


def random_dflash(target_model: Model, dt, rng: np.random.Generator, scale: float, *, block_size: int = 16,
                  mask_token_id: int | None = None, target_layer_ids=None, **shape) -> DraftModel:
    """A DFlash drafter with random weights (benchmarks of real shapes without files; the start
    of training). target_layer_ids: config.json's convention; default the spread of
    `default_target_layer_ids`, clipped to the target. shape: `random_config`'s keywords."""
    tcfg = target_model.config
    try:
        cfg = random_config(tcfg, **shape)
    except TypeError as e:
        raise ConfigError(f"random_drafter: {e}") from None
    if tcfg.num_hidden_layers < 2:
        raise ConfigError("a DFlash drafter needs a target of at least 2 layers")
    # Clipped to the readable layers [0, L - 2] for targets too shallow for the default spread.
    ids = target_layer_ids or sorted({min(max(i, 0), tcfg.num_hidden_layers - 2)
                                      for i in default_target_layer_ids(tcfg.num_hidden_layers, cfg.num_hidden_layers)})
    if any(not 0 <= i <= tcfg.num_hidden_layers - 2 for i in ids):
        raise ConfigError(f"target_layer_ids={list(ids)}: must be in [0, {tcfg.num_hidden_layers - 2}]")
    capture = tuple(i + 1 for i in ids)
    mask = tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id
    return build_draft_model("dflash", lambda: DFlashDrafter(cfg, capture_layers=capture, block_size=block_size,
                                                             mask_token_id=mask, dtype=dt),
                             lambda exp: random_params(exp, rng, scale, zero_centred_norm=False), dt, "<random>")
