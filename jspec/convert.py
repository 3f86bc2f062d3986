"""`jspec convert` and `jspec inspect`: HF safetensors -> orbax, and a one-screen summary."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from tqdm import tqdm

from checkpoints import orbax_io
from checkpoints.safetensors_reader import SafetensorsCheckpoint
from jspec.config import load_config
from jspec.errors import CheckpointError
from jspec.models.loader import abstract_model, flat_names, is_hf_dir, read_params, resolve_dtype
from jspec.sharding import check_tp, to_tp_layout

# Files that travel with the weights so the converted directory is self-contained.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")
META_FILE = orbax_io.META_FILE


def convert_checkpoint(hf_dir: str, out_dir: str, *, dtype: str = "bfloat16", progress: bool = True,
                       tp_size: int = 1, expert_parallel: bool = False, replicate_attention: bool = False) -> dict:
    """Read an HF checkpoint as jspec parameters (cast to `dtype`) and write them with orbax.
    tp_size: store the target's tensors in that split's layout (`jspec.sharding.to_tp_layout`), so
    an engine with the same tp_size restores every tensor straight onto its devices, each reading
    its own slice (any other tp_size still loads it, through host memory). expert_parallel /
    replicate_attention: the split's experts / token mixers kept whole (`jspec.sharding`)."""
    if not is_hf_dir(hf_dir):
        raise CheckpointError("no *.safetensors files here", file=hf_dir)
    config = load_config(hf_dir)
    dt = resolve_dtype(dtype)
    # the layout only: no devices here
    tp = check_tp(config, tp_size, num_devices=tp_size, ep=expert_parallel, replicate_attention=replicate_attention)
    ep, rep = expert_parallel and tp > 1, replicate_attention and tp > 1
    _, abstract = abstract_model(config, dt)
    bar = tqdm(total=len(flat_names(abstract)), desc="reading", unit="tensor", disable=not progress)
    params, extras, _ = read_params(hf_dir, config, dt, progress=lambda _: bar.update(1))
    bar.close()
    for name in list(params):  # one tensor at a time: the permuted copy replaces the original
        params[name] = to_tp_layout(name, np.asarray(params[name]), config, tp, ep=ep, replicate_attention=rep)
    if extras:  # MTP layers and the like: kept (in the chosen dtype) for the drafters that read them
        ckpt = SafetensorsCheckpoint(hf_dir)
        for name, hf_name in extras.items():
            params[name] = ckpt.get(hf_name).astype(np.dtype(dt))
    os.makedirs(out_dir, exist_ok=True)
    orbax_io.save_params(params, out_dir, progress=progress)
    for f in SIDE_FILES:
        src = os.path.join(hf_dir, f)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(out_dir, f))
    meta = {"source": os.path.abspath(hf_dir), "dtype": str(np.dtype(dt)), "num_tensors": len(params),
            "architecture": config.architecture, "tp_size": tp, "expert_parallel": ep,
            "replicate_attention": rep}
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def inspect_checkpoint(path: str) -> dict:
    """Architecture, layer pattern, parameter count and bytes, without loading the weights."""
    config = load_config(path)
    if orbax_io.is_orbax_dir(path):
        with open(os.path.join(path, META_FILE)) as f:
            stored = np.dtype(json.load(f)["dtype"])
        fmt = "orbax"
    elif is_hf_dir(path):
        ckpt = SafetensorsCheckpoint(path)
        stored = ckpt.dtype(ckpt.names()[0])
        fmt = "safetensors"
    else:
        raise CheckpointError("neither safetensors files nor an orbax checkpoint", file=path)
    _, abstract = abstract_model(config, stored)
    shapes = flat_names(abstract)
    count = int(sum(np.prod(s) for s in shapes.values()))
    return {
        "format": fmt,
        "architecture": config.architecture,
        "family": config.family,
        "num_layers": config.num_hidden_layers,
        "layer_pattern": config.layer_pattern(),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_parameters": count,
        "dtype": str(stored),
        "bytes": count * stored.itemsize,
        "num_tensors": len(shapes),
        "mtp_layers": config.num_mtp_layers,
    }
