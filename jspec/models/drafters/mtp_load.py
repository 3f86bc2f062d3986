"""NEXTN: the MTP layer of a Qwen3-Next / Qwen3.5 target, read from the target's own checkpoint.

Format: the target's directory (HF safetensors, or a `jspec convert` orbax directory, which keeps
them under the same names) stores the layer beside the target's weights as `mtp.*`: `mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a full-attention
decoder layer of the target family), `mtp.norm`. The target loader sets them aside; this reads
them again under the module's names (the `mtp.` prefix removed). The config is the target's,
cut to that one layer (`mtp.mtp_config`).
"""

from __future__ import annotations

import numpy as np

from jspec.config import ModelConfig
from jspec.errors import CheckpointError, ConfigError
from jspec.models.drafters.mtp import MTPDrafter, mtp_config
from jspec.models.drafters.reader import (DraftModel, TensorView, build_draft_model, checkpoint_storage,
                                          open_checkpoint, random_params, read_params)
from jspec.models.loader import Model

MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
PREFIX = "mtp."
MOE_TENSORS = ("layers.0.mlp.gate.", "layers.0.mlp.experts.")  # module names that only a MoE layer has


def check_mtp_family(target: ModelConfig) -> None:
    """ConfigError unless the target family has an MTP layer."""
    if target.family not in MTP_FAMILIES:
        raise ConfigError(f"NEXTN: a {target.family} target has no MTP layer (NEXTN serves "
                          f"{', '.join(MTP_FAMILIES)})")


def mtp_tensors(path: str) -> TensorView:
    """The `mtp.*` tensors of the target checkpoint at `path`, under the module's names."""
    stored_tensors = open_checkpoint(path)
    stored = {n[len(PREFIX):]: n for n in stored_tensors.names if n.startswith(PREFIX)}
    if not stored:
        raise CheckpointError("has no `mtp.*` tensors, so no MTP layer for NEXTN (a checkpoint exported "
                              "without its MTP weights?)", file=path)
    return TensorView(stored_tensors, stored, PREFIX)


def mtp_drafter_config(path: str, target: ModelConfig) -> ModelConfig:
    """The MTP layer's config without reading the checkpoint: the family check and the
    directory check that `load_mtp` makes first, then the target's config cut to one layer.

    Whether the layer is MoE is decided by its tensors when it is loaded (the target's
    `mlp_only_layers` speak of its own layers); here it is taken to follow the target, which
    changes `moe_layers` only, never the attention shape (one layer, the target's KV heads and
    head dim). Listing an orbax checkpoint's names means restoring it, which a config read
    should not do.
    """
    check_mtp_family(target)
    checkpoint_storage(path)
    return mtp_config(target, moe=target.num_experts > 0)


def load_mtp(path: str, target: Model, dt) -> DraftModel:
    """The MTP layer stored in the target checkpoint at `path`, in dtype `dt`."""
    tcfg = target.config
    check_mtp_family(tcfg)
    view = mtp_tensors(path)
    # Whether the MTP layer is MoE is read off its tensors: the target's mlp_only_layers speak
    # of its own layer indices, not of this one.
    moe = any(n.startswith(MOE_TENSORS) for n in view.names())
    if moe and tcfg.num_experts == 0:
        raise CheckpointError("MTP layer has experts but the target config has none",
                              tensor="mtp.layers.0.mlp.gate.weight")
    cfg = mtp_config(tcfg, moe=moe)
    return build_draft_model("mtp", lambda: MTPDrafter(cfg, dtype=dt), lambda exp: read_params(view, exp, dt),
                             dt, path)


def random_mtp(target_model: Model, dt, rng: np.random.Generator, scale: float, **shape) -> DraftModel:
    """An MTP layer with random weights. It takes no shape arguments: the layer is shaped like
    the target's full-attention layers (MoE when the target is)."""
    tcfg = target_model.config
    check_mtp_family(tcfg)
    if shape:
        raise ConfigError(f"random NEXTN drafter takes no shape arguments, got {sorted(shape)}")
    cfg = mtp_config(tcfg, moe=tcfg.num_experts > 0)
    return build_draft_model("mtp", lambda: MTPDrafter(cfg, dtype=dt),
                             lambda exp: random_params(exp, rng, scale, zero_centred_norm=cfg.zero_centred_norm),
                             dt, "<random>")
