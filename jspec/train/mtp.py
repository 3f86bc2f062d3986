"""MTP (NEXTN) layer training for a Qwen3-Next / Qwen3.5 target, and export into its checkpoint.

The layer is jspec's `MTPDrafter`: at row p it reads the token at p + 1 and the target's final
normed hidden at p and predicts the token at p + 2; later draft steps feed back its own normed
output (`jspec.speculative.eagle_step`). Training runs it densely and unrolled like the engine
chains it (`ttt`), against the frozen target's distribution; its embedding and lm_head are the
target's and stay frozen.

Export writes the layer as `mtp.*` tensors into the target's checkpoint, as Qwen3-Next ships it:
per-expert names for an MoE layer, replacing any `mtp.*` there before, beside the target's own
shards (a new shard and its index entries when the checkpoint is sharded, else inside
`model.safetensors`). transformers ignores `mtp.*`; jspec's NEXTN loader reads them.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from checkpoints.safetensors_reader import SafetensorsCheckpoint
from jspec.models import Model, load_model
from jspec.models.causal_lm import CausalLM
from jspec.models.drafters import MTPDrafter, load_drafter, random_drafter
from jspec.train import data
from jspec.train.dense import feed_forward
from jspec.train.export import hf_tensors
from jspec.train.frozen_target import merged, target_fn_for
from jspec.train.history import run_meta, save_history
from jspec.train.init import num_parameters
from jspec.train.loop import TrainConfig, fit, stderr_log
from jspec.train.ttt import step_positions, step_tokens, ttt_objective, ttt_self_attention

PREFIX = "mtp."
SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- model
def init_mtp(target: Model, *, seed: int = 0, from_checkpoint: bool = False) -> MTPDrafter:
    """A float32 MTP layer for `target`: random (norms at identity), or the `mtp.*` already in the
    target's directory (to train further)."""
    if from_checkpoint:
        return load_drafter("NEXTN", target.path, target, dtype="float32").module()
    return random_drafter("NEXTN", target, "float32", seed=seed).module()


def mtp_unrolled(drafter: MTPDrafter, target: CausalLM, window, final_hidden, num_steps: int) -> list[tuple]:
    """The MTP layer unrolled densely: [(logits `[B, T, V]` float32, hidden `[B, T, E]`)] per step.

    window `[B, T+1]`; final_hidden `[B, T, E]`: the target's final normed hidden over the first
    T tokens. Step 0 is the engine's catch-up, step i >= 1 its draft step i from every origin
    (see `ttt`). Matches the paged `MTPDrafter.__call__` step for step."""
    cfg, layer = drafter.config, drafter.layers[0]
    t = window.shape[1] - 1
    h = final_hidden
    kv, outs = [], []
    for i in range(num_steps):
        emb = drafter.pre_fc_norm_embedding(target.model.embed_tokens(step_tokens(window, i)))  # [B, T, E]
        x = drafter.fc(jnp.concatenate([emb, drafter.pre_fc_norm_hidden(h.astype(emb.dtype))], axis=-1))
        x = x + ttt_self_attention(layer.self_attn, layer.input_layernorm(x), step_positions(t, i), cfg.rope, kv)
        x = x + feed_forward(layer.mlp, layer.post_attention_layernorm(x))
        s = drafter.norm(x)
        outs.append((target.compute_logits(s), s))
        h = s
    return outs


def make_loss(target_graphdef, drafter_graphdef, *, num_steps: int, step_weight: float, compute_dtype,
              target_fn=None):
    """loss_fn(params, frozen, window) for `loop.make_steps`; frozen: {"target",
    "rest"} (the target's parameters; the layer's non-trained state, empty)."""
    target_fn = target_fn_for(TrainConfig()) if target_fn is None else target_fn

    def loss_fn(params, frozen, window):
        target, drafter = merged(target_graphdef, drafter_graphdef, params, frozen, compute_dtype)
        logits, final, _ = target_fn(target, window[:, :-1], ())
        outs = mtp_unrolled(drafter, target, window, jax.lax.stop_gradient(final), num_steps)
        return ttt_objective([lg for lg, _ in outs], jax.lax.stop_gradient(logits), step_weight=step_weight)

    return loss_fn


# ----------------------------------------------------------------------------- export
def export_mtp(drafter: MTPDrafter, target_dir: str, out_dir: str | None = None, *, dtype=None) -> list[str]:
    """Write the layer as `mtp.*` into a copy of the target checkpoint at `out_dir` (None: into
    `target_dir` itself). dtype: numpy dtype of the new tensors (default: the target's embedding's).
    Returns the names written."""
    dest = target_dir if out_dir is None else out_dir
    if os.path.abspath(dest) != os.path.abspath(target_dir):
        shutil.copytree(target_dir, dest, dirs_exist_ok=True)
    ckpt = SafetensorsCheckpoint(dest)
    names = ckpt.names()
    if dtype is None:
        dtype = ckpt.dtype(next(n for n in names if n.endswith("embed_tokens.weight")))
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    new = {PREFIX + k: v for k, v in hf_tensors(params, drafter.config, np.dtype(dtype), per_expert=True).items()}

    # Files and their tensors once the old layer is gone; the new one joins a file below.
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(ckpt.file_of(n), []).append(n)
    touched = {f for f, ns in by_file.items() if any(n.startswith(PREFIX) for n in ns)}
    kept = {f: {n: np.array(ckpt.get(n)) for n in ns if not n.startswith(PREFIX)} for f, ns in by_file.items()
            if f in touched}
    ckpt.close()
    sharded = os.path.exists(os.path.join(dest, INDEX))
    if not sharded:
        # One file for transformers to read: the layer goes into model.safetensors itself.
        home = "model.safetensors" if "model.safetensors" in by_file else sorted(by_file)[0]
        if home not in kept:
            with_home = SafetensorsCheckpoint(dest)
            kept[home] = {n: np.array(with_home.get(n)) for n in by_file[home]}
            with_home.close()
        kept[home].update(new)
    else:
        home = SHARD if SHARD not in by_file or SHARD in touched else "model-mtp-new.safetensors"
        kept[home] = {**kept.get(home, {}), **new}
    for f, tensors in kept.items():
        path = os.path.join(dest, f)
        if tensors:
            save_file(tensors, path + ".tmp", metadata={"format": "pt"})
            os.replace(path + ".tmp", path)
        elif os.path.exists(path):
            os.remove(path)
    if sharded:
        _update_index(os.path.join(dest, INDEX), new, home)
    _set_mtp_layers(os.path.join(dest, "config.json"))
    return sorted(new)


def _update_index(path: str, new: dict, shard: str) -> None:
    with open(path) as f:
        index = json.load(f)
    wm = {k: v for k, v in index["weight_map"].items() if not k.startswith(PREFIX)}
    wm.update({n: shard for n in new})
    index["weight_map"] = dict(sorted(wm.items()))
    with open(path, "w") as f:
        json.dump(index, f, indent=2)
    if "total_size" in index.get("metadata", {}):
        ckpt = SafetensorsCheckpoint(os.path.dirname(path))  # reads the index just written
        index["metadata"]["total_size"] = int(sum(ckpt.nbytes(n) for n in wm))
        ckpt.close()
        with open(path, "w") as f:
            json.dump(index, f, indent=2)


def _set_mtp_layers(path: str) -> None:
    """config.json: `mtp_num_hidden_layers` = 1 (inside text_config for a multimodal wrapper)."""
    with open(path) as f:
        cfg = json.load(f)
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    text["mtp_num_hidden_layers"] = 1
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


# ----------------------------------------------------------------------------- the run
def train_mtp(target_dir: str, corpus: str, heldout: str | None, out_dir: str | None, cfg: TrainConfig, *,
              from_checkpoint: bool = False, history_dir: str | None = None, compiler_options=None,
              log=stderr_log) -> dict:
    """Train the MTP layer of the Qwen3-Next / Qwen3.5 target at `target_dir` and write it as
    `mtp.*` into `out_dir` (a copy of the target; None: the target directory itself), with
    `mtp_history.{json,png}` in `history_dir` (default: out_dir). Returns a summary."""
    target = load_model(target_dir, dtype=cfg.dtype().name)
    drafter = init_mtp(target, seed=cfg.seed, from_checkpoint=from_checkpoint)
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    n_params = num_parameters(params)
    log(f"MTP layer: {n_params:,} parameters ({'MoE' if drafter.config.moe_layers[0] else 'dense'} block)")

    loss_fn = make_loss(target.graphdef, graphdef, num_steps=cfg.ttt_steps, step_weight=cfg.step_weight,
                        compute_dtype=cfg.dtype(), target_fn=target_fn_for(cfg))
    params, history, timing = fit(loss_fn, params, {"target": target.params, "rest": rest},
                                  data.load_tokens(corpus), heldout, cfg, compiler_options=compiler_options, log=log)

    trained = nnx.merge(graphdef, params, rest)
    dest = target_dir if out_dir is None else out_dir
    written = export_mtp(trained, target_dir, dest)
    meta = run_meta("mtp", target_dir, corpus, heldout, cfg, history, timing, num_parameters=n_params,
                    num_tensors=len(written))
    paths = save_history(history, history_dir or dest, "mtp", meta=meta)
    log(f"wrote {len(written)} mtp.* tensors into {dest}; history {paths['json']}")
    return {**meta, "paths": paths, "drafter": trained}
