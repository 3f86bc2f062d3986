"""Map a Hugging Face checkpoint's tensor names onto jspec parameter names.

jspec's parameter names are HF's own (`model.layers.3.self_attn.q_proj.weight`), so the mapping
only has to:
- move a nested decoder prefix (`model.language_model.` in Qwen3.5 hub checkpoints) to `model.`;
- stack per-expert MoE tensors (`mlp.experts.7.gate_proj.weight`) into jspec's fused layout
  `mlp.experts.gate_up_proj [X, E, 2I]` / `mlp.experts.down_proj [X, I, E]` (`[X, in, out]`; HF's
  fused `[X, out, in]`, as transformers >= 5 names it, is transposed once at load);
- set aside tensors another component owns (`mtp.*` for the MTP drafter) and skip those nobody
  reads (vision tower, rotary buffers, a tied lm_head).

The caller says which names and shapes it expects; anything missing, unexpected or mis-shaped
raises `CheckpointError` naming the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import numpy as np

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_reader import SafetensorsCheckpoint

# Tensors present in some checkpoints that no jspec component reads.
_SKIP = (
    re.compile(r"^model\.visual\."),
    re.compile(r"^visual\."),
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
)
_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# jspec projections that concatenate several HF ones (rows in this order).
_FUSED = (
    (re.compile(r"^(?P<prefix>.*\.self_attn)\.qkv_proj\.(?P<kind>weight|bias)$"), ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"^(?P<prefix>.*\.(?:mlp|shared_expert))\.gate_up_proj\.(?P<kind>weight|bias)$"),
     ("gate_proj", "up_proj")),
)


def fused_parts(name: str) -> list[str] | None:
    """HF names whose row-concatenation is jspec parameter `name`, or None if it is not fused."""
    for pattern, parts in _FUSED:
        m = pattern.match(name)
        if m:
            return [f"{m['prefix']}.{p}.{m['kind']}" for p in parts]
    return None
EXTRA_PREFIXES = ("mtp.",)


def canonical_name(hf_name: str, weight_prefix: str) -> str:
    """HF name -> jspec name (decoder prefix normalised to `model.`)."""
    if weight_prefix != "model." and hf_name.startswith(weight_prefix):
        return "model." + hf_name[len(weight_prefix):]
    return hf_name


def _cast(arr: np.ndarray, dtype) -> np.ndarray:
    if dtype is None or arr.dtype == np.dtype(dtype):
        return arr  # zero-copy view of the file
    return arr.astype(dtype)


def _fused_expert(arr: np.ndarray, name: str, want: tuple) -> np.ndarray:
    """jspec stores experts `[X, in, out]`. HF >= 5 writes `[X, out, in]` (transposed here, once, at
    load); a checkpoint already in `[X, in, out]` passes through. When in == out the two cannot be
    told apart and HF's layout is assumed."""
    if arr.ndim == 3 and (arr.shape[0], arr.shape[2], arr.shape[1]) == tuple(want):
        return np.ascontiguousarray(np.swapaxes(arr, 1, 2))
    if tuple(arr.shape) == tuple(want):
        return arr
    raise CheckpointError(f"shape {tuple(arr.shape)} does not match expected {tuple(want)}", tensor=name)


def _hf_name(name: str, weight_prefix: str) -> str:
    if weight_prefix != "model." and name.startswith("model."):
        return weight_prefix + name[len("model."):]
    return name


def to_hf_tensors(name: str, arr: np.ndarray, split_sizes: list[int] | None = None) -> dict[str, np.ndarray]:
    """Inverse of the load-time mapping, for writing HF-format files from jspec parameters.

    Fused projections need the row count of each part (`split_sizes`)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return {name: np.ascontiguousarray(np.swapaxes(arr, 1, 2))}
    parts = fused_parts(name)
    if parts:
        if split_sizes is None:
            raise ValueError(f"{name}: split_sizes needed to un-fuse")
        pieces = np.split(arr, np.cumsum(split_sizes)[:-1], axis=0)
        return {p: np.ascontiguousarray(x) for p, x in zip(parts, pieces)}
    return {name: arr}


def load_params(
    ckpt: SafetensorsCheckpoint,
    expected: Mapping[str, tuple],
    *,
    weight_prefix: str = "model.",
    tied_lm_head: bool = False,
    dtype=None,
    progress: Callable | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read every expected parameter from an HF checkpoint.

    expected: jspec name -> shape. Returns (params: jspec name -> array, extras: jspec name -> HF
    name of tensors set aside for other components, e.g. `mtp.*`). dtype: cast to it (None keeps
    the file's dtype; arrays that need no cast are zero-copy views).
    """
    params: dict[str, np.ndarray] = {}
    extras: dict[str, str] = {}
    part_of = {}  # HF part name -> (jspec fused name, position)
    for name in expected:
        for i, part in enumerate(fused_parts(name) or ()):
            part_of[part] = (name, i)
    fused: dict[str, dict[int, str]] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}  # layer prefix -> idx -> proj -> hf name
    direct: dict[str, str] = {}  # jspec name -> hf name

    for hf in ckpt.names():
        if any(p.search(hf) for p in _SKIP):
            continue
        name = canonical_name(hf, weight_prefix)
        if name.startswith(EXTRA_PREFIXES):
            extras[name] = hf
            continue
        if tied_lm_head and name == "lm_head.weight":
            continue  # tied to embed_tokens; some writers store a copy anyway
        if name in part_of:
            target, i = part_of[name]
            fused.setdefault(target, {})[i] = hf
            continue
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m["layer"], {}).setdefault(int(m["idx"]), {})[m["proj"]] = hf
            continue
        if name not in expected:
            raise CheckpointError("unexpected tensor: no parameter of this model has this name", tensor=hf)
        direct[name] = hf

    for name, hf in direct.items():
        want = tuple(expected[name])
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            arr = _fused_expert(ckpt.get(hf), hf, want)
        else:
            if tuple(ckpt.shape(hf)) != want:
                raise CheckpointError(
                    f"shape {tuple(ckpt.shape(hf))} does not match expected {want}", tensor=hf
                )
            arr = ckpt.get(hf)
        params[name] = _cast(arr, dtype)
        if progress:
            progress(name)

    for name, parts in fused.items():
        want = tuple(expected[name])
        hf_parts = fused_parts(name)
        for i, part in enumerate(hf_parts):
            if i not in parts:
                raise CheckpointError("missing tensor", tensor=_hf_name(part, weight_prefix))
        arrs = [ckpt.get(parts[i]) for i in range(len(hf_parts))]
        cat = np.concatenate(arrs, axis=0)
        if tuple(cat.shape) != want:
            shapes = ", ".join(f"{parts[i]} {tuple(a.shape)}" for i, a in enumerate(arrs))
            raise CheckpointError(f"shapes ({shapes}) do not concatenate to the expected {want}",
                                  tensor=parts[0])
        params[name] = _cast(cat, dtype)
        if progress:
            progress(name)

    for layer, per_expert in experts.items():
        gate_up_name, down_name = f"{layer}.gate_up_proj", f"{layer}.down_proj"
        if gate_up_name not in expected:
            some = next(iter(next(iter(per_expert.values())).values()))
            raise CheckpointError("unexpected tensor: this layer has no experts", tensor=some)
        num_experts = expected[gate_up_name][0]
        gate_up, down = [], []
        for j in range(num_experts):
            projs = per_expert.get(j, {})
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if proj not in projs:
                    raise CheckpointError("missing tensor", tensor=f"{layer}.{j}.{proj}.weight")
            g, u, d = (ckpt.get(projs[p]) for p in ("gate_proj", "up_proj", "down_proj"))
            gate_up.append(np.concatenate([g, u], axis=0).T)  # [E, 2I]: jspec's [in, out]
            down.append(d.T)  # [I, E]
        extra_idx = sorted(set(per_expert) - set(range(num_experts)))
        if extra_idx:
            raise CheckpointError("unexpected tensor: expert index beyond num_experts",
                                  tensor=next(iter(per_expert[extra_idx[0]].values())))
        for name, arrs in ((gate_up_name, gate_up), (down_name, down)):
            stacked = np.stack(arrs)
            if tuple(stacked.shape) != tuple(expected[name]):
                raise CheckpointError(
                    f"stacked experts have shape {tuple(stacked.shape)}, expected {tuple(expected[name])}",
                    tensor=name,
                )
            params[name] = _cast(stacked, dtype)
            if progress:
                progress(name)

    missing = sorted(set(expected) - set(params))
    if missing and fused_parts(missing[0]):
        missing = [_hf_name(fused_parts(missing[0])[0], weight_prefix)] + missing[1:]
    if missing:
        raise CheckpointError(f"missing tensor (and {len(missing) - 1} more)" if len(missing) > 1
                              else "missing tensor", tensor=missing[0])
    return params, extras
