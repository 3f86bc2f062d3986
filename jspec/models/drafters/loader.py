"""Build a drafter from its published checkpoint format (or with random weights): the dispatch.

kind is SGLang's algorithm name, and each has its own reader:
- EAGLE, EAGLE3: a head directory (`eagle_load.py`);
- NEXTN: the target's own directory, whose `mtp.*` tensors hold the MTP layer (`mtp_load.py`);
- DFLASH: z-lab's block drafter (`dflash_load.py`).

All of them read through `reader.py`: tensors are checked against the names of the drafter
module with the target loader's mapping, so a checkpoint tensor that is missing, unexpected or
mis-shaped raises `CheckpointError` naming it, as for targets.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jspec.config import ModelConfig
from jspec.errors import ConfigError
from jspec.models.drafters.dflash_load import dflash_drafter_config, load_dflash, random_dflash
from jspec.models.drafters.eagle_load import (EAGLE3_ARCHITECTURES, EAGLE_ARCHITECTURES, head_drafter_config,
                                              load_head, random_head)
from jspec.models.drafters.mtp_load import load_mtp, mtp_drafter_config, random_mtp
from jspec.models.drafters.reader import DraftModel
from jspec.models.loader import Model, resolve_dtype

KINDS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp", "DFLASH": "dflash"}  # SGLang algorithm -> Drafter.kind

__all__ = ["KINDS", "DraftModel", "checkpoint_format", "drafter_config", "drafter_kind", "load_drafter",
           "random_drafter"]


def drafter_kind(algorithm: str) -> str:
    """`Drafter.kind` of an SGLang algorithm name (any case); ConfigError for an unknown one."""
    algo = str(algorithm).upper()
    if algo not in KINDS:
        raise ConfigError(f"drafter kind {algorithm!r}: choose from {', '.join(KINDS)}")
    return KINDS[algo]


def _draft_dir(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"draft model path {path!r} is not a directory")
    return path


def checkpoint_format(path: str | os.PathLike) -> str:
    """"EAGLE" or "EAGLE3": which head format a draft directory holds, from its config.json
    architectures (NAIVE_EAGLE takes either)."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(file):
        raise ConfigError(f"speculative_draft_model_path={os.fspath(path)!r} has no config.json")
    with open(file) as f:
        archs = json.load(f).get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in archs):
        return "EAGLE3"
    if any(a in EAGLE_ARCHITECTURES for a in archs):
        return "EAGLE"
    raise ConfigError(f"speculative_draft_model_path={os.fspath(path)!r}: architectures {archs} are neither an "
                      f"EAGLE ({', '.join(EAGLE_ARCHITECTURES)}) nor an EAGLE3 head ({', '.join(EAGLE3_ARCHITECTURES)})")


def load_drafter(kind: str, path: str | os.PathLike, target: Model, dtype=None) -> DraftModel:
    """Load an EAGLE / EAGLE3 head or DFlash directory, or (NEXTN) the MTP layer of the target's
    directory.

    kind: SGLang's algorithm name. dtype: None keeps the target's.
    """
    kind = drafter_kind(kind)
    dt = target.dtype if dtype is None else resolve_dtype(dtype)
    path = _draft_dir(path)
    if kind == "dflash":
        return load_dflash(path, target, dt)
    if kind == "mtp":
        return load_mtp(path, target, dt)
    return load_head(kind, path, target, dt)


def drafter_config(kind: str | None, path: str | os.PathLike, target: ModelConfig) -> ModelConfig:
    """The drafter's own ModelConfig (its attention layers, KV heads, head dim: what sizes its KV
    pool), read from config.json alone, before any weight is: it equals `load_drafter(kind, path,
    ...).config` (for NEXTN, up to whether the MTP layer is MoE, see `mtp_drafter_config`).

    kind: "EAGLE" | "EAGLE3" | "NEXTN" | "DFLASH", or None to detect an EAGLE / EAGLE3 head
    with `checkpoint_format`. target: the target's config. Raises the ConfigError / CheckpointError
    that `load_drafter` would raise for the directory before reading tensors, so a bad directory
    is reported the same way whichever is called first.
    """
    kind = None if kind is None else drafter_kind(kind)
    path = _draft_dir(path)
    kind = kind or drafter_kind(checkpoint_format(path))
    if kind == "dflash":
        return dflash_drafter_config(path, target)
    if kind == "mtp":
        return mtp_drafter_config(path, target)
    return head_drafter_config(kind, path, target)


def random_drafter(kind: str, target_model: Model, dtype="bfloat16", seed: int = 0, scale: float = 0.02,
                   **shape) -> DraftModel:
    """A drafter with random weights for `target_model` (benchmarks of real shapes without files).

    shape (EAGLE / EAGLE3): intermediate_size, num_attention_heads, num_key_value_heads, head_dim
    (default: the target's); EAGLE3 also draft_vocab_size (default the target's vocab, else a
    random subset of it through d2t) and aux_layer_ids (config.json's convention; default
    SGLang's). NEXTN takes none: its layer is shaped like the target's full-attention layers.
    DFLASH: num_layers (5), block_size (16), mask_token_id (the last id) and the shapes above.
    """
    kind = drafter_kind(kind)
    dt = resolve_dtype(dtype)
    rng = np.random.default_rng(seed)
    if kind == "dflash":
        return random_dflash(target_model, dt, rng, scale, **shape)
    if kind == "mtp":
        return random_mtp(target_model, dt, rng, scale, **shape)
    return random_head(kind, target_model, dt, rng, scale, **shape)
