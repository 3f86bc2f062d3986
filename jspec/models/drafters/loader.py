"""Build a drafter from its published checkpoint format (or with random weights).

- EAGLE: an HF directory (config.json of a one-layer Llama, tensors without the `model.` prefix);
- EAGLE3: the same, plus `d2t` / `t2d` and the aux-layer ids in config.json;
- NEXTN: the target's own directory, whose `mtp.*` tensors hold the MTP layer;
- DFLASH: z-lab's block drafter (`dflash_load.py`).

Parameters go through the target loader's mapping (`checkpoints/hf_mapping.py`: fused qkv /
gate_up, stacked experts) against the names of the drafter module, so a checkpoint tensor that is
missing, unexpected or mis-shaped raises `CheckpointError` naming it, as for targets.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints import hf_mapping, orbax_io
from checkpoints.safetensors_reader import SafetensorsCheckpoint
from jspec.config import FULL_ATTENTION, ModelConfig, RopeConfig, parse_hf_config
from jspec.errors import CheckpointError, ConfigError, UnsupportedModelError
from jspec.models.drafters.base import Drafter
from jspec.models.drafters.eagle import EagleDrafter
from jspec.models.drafters.eagle3 import Eagle3Drafter
from jspec.models.drafters.mtp import MTPDrafter, mtp_config
from jspec.models.loader import Model, flat_names, is_hf_dir, resolve_dtype

KINDS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp", "DFLASH": "dflash"}  # SGLang algorithm -> Drafter.kind
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLM", "EagleLlamaForCausalLM")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
D2T = "d2t"


@dataclasses.dataclass
class DraftModel:
    """A loaded drafter, like `jspec.models.loader.Model`: merge graphdef and params (inside a
    jitted step) to get the `Drafter` module."""

    kind: str  # Drafter.kind: "eagle" | "eagle3" | "mtp" | "dflash"
    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: jnp.dtype
    path: str
    capture_layers: tuple[int, ...] = ()
    block_size: int | None = None  # DFlash: tokens per draft block, as trained

    def module(self) -> Drafter:
        return nnx.merge(self.graphdef, self.params)

    def num_bytes(self) -> int:
        return sum(int(x.size * x.dtype.itemsize) for x in jax.tree_util.tree_leaves(self.params))


# ----------------------------------------------------------------------------- checkpoint view


class _Tensors:
    """The drafter's tensors of a checkpoint under the drafter module's names (the stored names
    less a prefix such as `mtp.`). `hf_mapping.load_params` reads through this view; its errors
    are renamed back to the stored names."""

    def __init__(self, get, shape, stored: dict[str, str], prefix: str):
        self._get, self._shape, self._stored, self.prefix = get, shape, stored, prefix

    def names(self) -> list[str]:
        return sorted(self._stored)

    def __contains__(self, name) -> bool:
        return name in self._stored

    def get(self, name: str) -> np.ndarray:
        return self._get(self._stored[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shape(self._stored[name]))

    def stored(self, name: str) -> str:
        return self._stored.get(name, self.prefix + name)

    def take(self, name: str) -> np.ndarray | None:
        """Remove a tensor that is read by hand (d2t) from the view; None when absent."""
        if name not in self._stored:
            return None
        arr = self.get(name)
        del self._stored[name]
        return arr


def _open(path: str):
    """(get, shape, names) of an HF safetensors directory or a `jspec convert` orbax directory."""
    if orbax_io.is_orbax_dir(path):
        # `jspec convert` keeps `mtp.*` under their HF names; orbax restores the whole item.
        flat = orbax_io.load_params(path)
        return flat.__getitem__, (lambda n: flat[n].shape), list(flat)
    if not is_hf_dir(path):
        raise CheckpointError("holds neither *.safetensors files nor an orbax checkpoint", file=path)
    ckpt = SafetensorsCheckpoint(path)
    return ckpt.get, ckpt.shape, ckpt.names()


def _head_tensors(path: str, drop: tuple[str, ...] = ()) -> _Tensors:
    """An EAGLE / EAGLE3 head: names without `model.`, though some writers add it."""
    get, shape, names = _open(path)
    stored = {}
    prefixed = any(n.startswith("model.") for n in names)
    for n in names:
        name = n[len("model."):] if n.startswith("model.") else n
        if name in drop:
            continue
        if name in stored:
            raise CheckpointError("stored both with and without the `model.` prefix", tensor=n)
        stored[name] = n
    return _Tensors(get, shape, stored, "model." if prefixed else "")


def _mtp_tensors(path: str) -> _Tensors:
    get, shape, names = _open(path)
    stored = {n[len("mtp."):]: n for n in names if n.startswith("mtp.")}
    if not stored:
        raise CheckpointError("has no `mtp.*` tensors, so no MTP layer for NEXTN (a checkpoint exported "
                              "without its MTP weights?)", file=path)
    return _Tensors(get, shape, stored, "mtp.")


def _renamed(e: CheckpointError, src: _Tensors) -> CheckpointError:
    if e.tensor is None:
        return e
    stored = src.stored(e.tensor)
    out = CheckpointError(str(e).replace(f"tensor {e.tensor!r}", f"tensor {stored!r}", 1))
    out.tensor, out.file = stored, e.file
    return out


# ----------------------------------------------------------------------------- configs


def _read_json(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise ConfigError(f"no config.json in draft model path {path!r}")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None


def _head_config(raw: dict, kind: str, target: ModelConfig) -> ModelConfig:
    """Parse an EAGLE / EAGLE3 config.json (a one-layer Llama) and check it against the target."""
    arch = (raw.get("architectures") or [None])[0]
    allowed = EAGLE3_ARCHITECTURES if kind == "eagle3" else EAGLE_ARCHITECTURES
    if arch not in allowed:
        raise UnsupportedModelError(f"draft config.json: architectures={arch!r} is not an {kind.upper()} head "
                                    f"(expected one of {', '.join(allowed)})")
    if raw.get("num_hidden_layers", 1) != 1:
        raise UnsupportedModelError(f"draft config.json: num_hidden_layers={raw['num_hidden_layers']}: only "
                                    "one-layer heads are supported")
    # The layer is Llama's, so the Llama parser reads it; the architecture is restored after.
    patched = {k: v for k, v in raw.items() if k != "layer_types"}
    cfg = parse_hf_config({**patched, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    cfg = cfg.replace(architecture=arch, weight_prefix="")
    for field, value in (("hidden_size", cfg.hidden_size), ("target_hidden_size", raw.get("target_hidden_size"))):
        if value is not None and value != target.hidden_size:
            raise ConfigError(f"draft config.json: {field}={value} must equal the target's hidden_size="
                              f"{target.hidden_size} (the head reads and feeds back the target's hidden states)")
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocab_size={cfg.vocab_size} must equal the target's vocab_size={target.vocab_size}")
    return cfg


def eagle3_capture_layers(raw: dict, num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose entering stream EAGLE3 reads, ascending (the order fc was trained on).

    config.json's `eagle_aux_hidden_state_layer_ids` name layers whose *output* is read, i.e.
    the stream entering layer id + 1. Without them, SGLang's default (2, L // 2, L - 3), which are
    entering indices already; for targets too shallow for those (tiny test models) they are
    clipped to [0, L] and, where that merges two, completed with the smallest unused indices, so
    there are always three distinct ones.
    """
    n_layers = num_target_layers
    eagle_cfg = raw.get("eagle_config") or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    if ids is not None:
        layers = [int(i) + 1 for i in ids]
        # At least two: the head tells the target's streams [T, n*E] from its own fed-back hidden
        # [T, E] by width alone.
        if len(layers) < 2 or any(not 0 <= i <= n_layers for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"draft config.json: eagle_aux_hidden_state_layer_ids={list(ids)} must be at least "
                              f"two distinct layer ids in [-1, {n_layers - 1}] of the {n_layers}-layer target")
        return tuple(sorted(layers))
    if n_layers < 2:
        raise ConfigError(f"EAGLE3 needs a target with at least 2 layers, got {n_layers}")
    chosen = sorted({min(max(i, 0), n_layers) for i in (2, n_layers // 2, n_layers - 3)})
    spare = (i for i in range(n_layers + 1) if i not in chosen)
    while len(chosen) < 3:
        chosen.append(next(spare))
    return tuple(sorted(chosen))


def _llama_head_config(target: ModelConfig, arch: str, *, intermediate_size=None, num_attention_heads=None,
                       num_key_value_heads=None, head_dim=None) -> ModelConfig:
    """A one-layer Llama head config shaped after the target (random drafters)."""
    heads = num_attention_heads or target.num_attention_heads
    head_dim = head_dim or target.head_dim
    inter = intermediate_size or target.intermediate_size
    if inter <= 0:
        raise ConfigError("random drafter: the target has no dense intermediate_size; pass intermediate_size=")
    rope = target.rope
    if rope.rotary_dim != head_dim:  # heads are trained with full rotary
        rope = RopeConfig(theta=rope.theta, rotary_dim=head_dim)
    return ModelConfig(
        architecture=arch, family="llama", weight_prefix="", vocab_size=target.vocab_size,
        hidden_size=target.hidden_size, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or target.num_key_value_heads, head_dim=head_dim,
        intermediate_size=inter, rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, rope=rope, zero_centred_norm=False, qk_norm=False, attn_output_gate=False,
        layer_types=(FULL_ATTENTION,), moe_layers=(False,), torch_dtype=target.torch_dtype,
    )


def _kind(kind: str) -> str:
    algo = str(kind).upper()
    if algo not in KINDS:
        raise ConfigError(f"drafter kind {kind!r}: choose from {', '.join(KINDS)}")
    return KINDS[algo]


def _check_mtp_family(target: ModelConfig) -> None:
    if target.family not in MTP_FAMILIES:
        raise ConfigError(f"NEXTN: a {target.family} target has no MTP layer (NEXTN serves "
                          f"{', '.join(MTP_FAMILIES)})")


# ----------------------------------------------------------------------------- building


def _fill(state: nnx.State, flat: dict) -> nnx.State:
    """A copy of the abstract `state` with every leaf from `flat`, in the leaf's own dtype (the
    parameters' dtype, int32 for d2t)."""
    def fill(path, leaf):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return jnp.asarray(flat[name], dtype=leaf.dtype)

    filled = jax.tree_util.tree_map_with_path(fill, state.to_pure_dict())
    new_state = jax.tree_util.tree_map(lambda x: x, state)
    nnx.replace_by_pure_dict(new_state, filled)
    return new_state


def _finish(kind: str, make, flat_fn, dt, path: str) -> DraftModel:
    """Create the module abstractly, fill it from `flat_fn(expected names -> shapes)`."""
    module = nnx.eval_shape(make)
    graphdef, abstract = nnx.split(module)
    flat = flat_fn(flat_names(abstract))
    return DraftModel(kind=kind, config=module.config, graphdef=graphdef, params=_fill(abstract, flat),
                      dtype=dt, path=path, capture_layers=tuple(module.capture_layers),
                      block_size=getattr(module, "block_size", None))


def _read(src: _Tensors, expected: dict, dt) -> dict:
    try:
        params, _ = hf_mapping.load_params(src, expected, dtype=np.dtype(dt))
    except CheckpointError as e:
        raise _renamed(e, src) from None
    return params


def _read_d2t(src: _Tensors, draft_vocab: int, vocab: int, required: bool) -> np.ndarray | None:
    d2t = src.take(D2T)
    src.take("t2d")  # the inverse map (a mask over the target vocabulary); not needed to draft
    if d2t is None:
        if required:
            raise CheckpointError(f"missing tensor: draft_vocab_size={draft_vocab} < vocab_size={vocab} needs the "
                                  "draft -> target id map", tensor=src.stored(D2T))
        return None
    if d2t.shape != (draft_vocab,):
        raise CheckpointError(f"shape {tuple(d2t.shape)} does not match (draft_vocab_size,) = ({draft_vocab},)",
                              tensor=src.stored(D2T))
    targets = np.arange(draft_vocab) + d2t.astype(np.int64)
    if targets.min(initial=0) < 0 or targets.max(initial=0) >= vocab:
        raise CheckpointError(f"maps draft ids outside the target vocabulary [0, {vocab})", tensor=src.stored(D2T))
    return d2t.astype(np.int32)


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
    """Load an EAGLE / EAGLE3 head directory, or (NEXTN) the MTP layer of the target's directory.

    kind: SGLang's algorithm name. dtype: None keeps the target's.
    """
    kind, path = _kind(kind), os.fspath(path)
    dt = target.dtype if dtype is None else resolve_dtype(dtype)
    tcfg = target.config
    if not os.path.isdir(path):
        raise ConfigError(f"draft model path {path!r} is not a directory")
    if kind == "dflash":
        from jspec.models.drafters.dflash_load import load_dflash

        return load_dflash(path, target, dt)

    if kind == "mtp":
        _check_mtp_family(tcfg)
        src = _mtp_tensors(path)
        # Whether the MTP layer is MoE is read off its tensors: the target's mlp_only_layers speak
        # of its own layer indices, not of this one.
        moe = any(n.startswith(("layers.0.mlp.gate.", "layers.0.mlp.experts.")) for n in src.names())
        if moe and tcfg.num_experts == 0:
            raise CheckpointError("MTP layer has experts but the target config has none",
                                  tensor="mtp.layers.0.mlp.gate.weight")
        cfg = mtp_config(tcfg, moe=moe)
        return _finish(kind, lambda: MTPDrafter(cfg, dtype=dt), lambda exp: _read(src, exp, dt), dt, path)

    raw = _read_json(path)
    cfg = _head_config(raw, kind, tcfg)
    drop = ("lm_head.weight",) if kind == "eagle" else ()  # EAGLE drafts with the target's lm_head (as SGLang)
    src = _head_tensors(path, drop=drop)
    fc_bias = "fc.bias" in src or bool(raw.get("bias", False))
    own_embed = "embed_tokens.weight" in src
    if kind == "eagle":
        return _finish(kind, lambda: EagleDrafter(cfg, own_embed=own_embed, fc_bias=fc_bias, dtype=dt),
                       lambda exp: _read(src, exp, dt), dt, path)

    vocab = tcfg.vocab_size
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ConfigError(f"draft config.json: draft_vocab_size={draft_vocab} must be in [1, vocab_size={vocab}]")
    capture = eagle3_capture_layers(raw, tcfg.num_hidden_layers)
    e = cfg.hidden_size
    if "fc.weight" in src and src.shape("fc.weight") != (e, len(capture) * e):
        raise CheckpointError(f"shape {src.shape('fc.weight')}: fc reads the {len(capture)} captured target layers "
                              f"{capture} x hidden_size {e}, so its input width must be {len(capture) * e}",
                              tensor=src.stored("fc.weight"))
    d2t = _read_d2t(src, draft_vocab, vocab, required=draft_vocab != vocab)
    own_head = "lm_head.weight" in src or draft_vocab != vocab  # else: the target's (SGLang's load_lm_head_from_target)

    def make():
        return Eagle3Drafter(cfg, capture_layers=capture, draft_vocab_size=draft_vocab, own_embed=own_embed,
                             own_head=own_head, has_d2t=d2t is not None, fc_bias=fc_bias, dtype=dt)

    def flat(expected):
        expected = {k: v for k, v in expected.items() if k != D2T}
        params = _read(src, expected, dt)
        return params if d2t is None else {**params, D2T: d2t}

    return _finish(kind, make, flat, dt, path)


# ----------------------------------------------------------------------------- random weights


def random_drafter(kind: str, target_model: Model, dtype="bfloat16", seed: int = 0, scale: float = 0.02,
                   **shape) -> DraftModel:
    """A drafter with random weights for `target_model` (benchmarks of real shapes without files).

    shape (EAGLE / EAGLE3): intermediate_size, num_attention_heads, num_key_value_heads, head_dim
    (default: the target's); EAGLE3 also draft_vocab_size (default the target's vocab, else a
    random subset of it through d2t) and aux_layer_ids (config.json's convention; default
    SGLang's). NEXTN takes none: its layer is shaped like the target's full-attention layers.
    DFLASH: num_layers (5), block_size (16), mask_token_id (the last id) and the shapes above.
    """
    kind = _kind(kind)
    dt = resolve_dtype(dtype)
    tcfg = target_model.config
    rng = np.random.default_rng(seed)
    d2t = None
    if kind == "dflash":
        from jspec.models.drafters.dflash_load import random_dflash

        return random_dflash(target_model, dt, rng, scale, **shape)
    if kind == "mtp":
        _check_mtp_family(tcfg)
        if shape:
            raise ConfigError(f"random NEXTN drafter takes no shape arguments, got {sorted(shape)}")
        cfg = mtp_config(tcfg, moe=tcfg.num_experts > 0)

        def make():
            return MTPDrafter(cfg, dtype=dt)
    else:
        draft_vocab = int(shape.pop("draft_vocab_size", tcfg.vocab_size)) if kind == "eagle3" else tcfg.vocab_size
        aux = shape.pop("aux_layer_ids", None) if kind == "eagle3" else None
        try:
            arch = "LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLMEagle"
            cfg = _llama_head_config(tcfg, arch, **shape)
        except TypeError as e:
            raise ConfigError(f"random_drafter: {e}") from None
        if kind == "eagle":
            def make():
                return EagleDrafter(cfg, own_embed=False, fc_bias=False, dtype=dt)
        else:
            if not 0 < draft_vocab <= tcfg.vocab_size:
                raise ConfigError(f"draft_vocab_size={draft_vocab} must be in [1, vocab_size={tcfg.vocab_size}]")
            raw = {} if aux is None else {"eagle_aux_hidden_state_layer_ids": list(aux)}
            capture = eagle3_capture_layers(raw, tcfg.num_hidden_layers)
            if draft_vocab != tcfg.vocab_size:
                hot = np.sort(rng.choice(tcfg.vocab_size, size=draft_vocab, replace=False))
                d2t = (hot - np.arange(draft_vocab)).astype(np.int32)

            def make():
                return Eagle3Drafter(cfg, capture_layers=capture, draft_vocab_size=draft_vocab, own_embed=False,
                                     own_head=True, has_d2t=d2t is not None, fc_bias=False, dtype=dt)

    def flat(expected):
        # Drawn on the host: one numpy call per tensor, where jax.random would compile per shape.
        out = {}
        for name, shp in sorted(expected.items()):
            if name == D2T:
                out[name] = d2t
            elif name.endswith(("norm.weight", "layernorm.weight", "norm_embedding.weight", "norm_hidden.weight")):
                out[name] = np.full(shp, 0.0 if cfg.zero_centred_norm else 1.0, np.float32)
            else:
                out[name] = scale * rng.standard_normal(shp, dtype=np.float32)
        return out

    return _finish(kind, make, flat, dt, "<random>")
