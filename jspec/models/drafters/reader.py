"""Reading a drafter checkpoint: the part every format's loader does the same way.

A drafter's tensors are read under the names of the drafter module (the dotted paths of its
abstract state, e.g. `fc.weight`), not under the stored ones: a head may store `fc.weight` or
`model.fc.weight`, the MTP layer stores `mtp.fc.weight`. `TensorView` is that renaming, and it is
what `checkpoints.hf_mapping.load_params` reads through, so drafters get the target loader's
mapping (fused qkv / gate_up, stacked experts) and its checks (a missing, unexpected or
mis-shaped tensor raises `CheckpointError` naming it). `read_params` renames those errors back
to the stored names, so that a message names a tensor the user can find in the files.

The format modules (`eagle_load`, `mtp_load`, `dflash_load`) decide which tensors form the view
and which module to build; `build_draft_model` then creates that module abstractly (no weights
are allocated twice) and fills it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints import hf_mapping, orbax_io
from checkpoints.safetensors_reader import SafetensorsCheckpoint
from jspec.config import ModelConfig
from jspec.errors import CheckpointError, ConfigError
from jspec.models.drafters.base import Drafter
from jspec.models.loader import flat_names, is_hf_dir

ORBAX, SAFETENSORS = "orbax", "safetensors"


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


# ----------------------------------------------------------------------------- the stored tensors


class StoredTensors(NamedTuple):
    """A checkpoint's tensors under their stored names: `get(name)` -> host array, `shape(name)`,
    and every stored name. Reading a safetensors tensor maps its bytes only when it is asked for."""

    get: Callable[[str], np.ndarray]
    shape: Callable[[str], tuple[int, ...]]
    names: list[str]


def checkpoint_storage(path: str) -> str:
    """ORBAX or SAFETENSORS: how the directory `path` stores its tensors, from its file names
    alone (nothing is read), so callers that only check a directory stay cheap.

    Raises CheckpointError when it holds neither, the error `open_checkpoint` raises.
    """
    if orbax_io.is_orbax_dir(path):
        return ORBAX
    if not is_hf_dir(path):
        raise CheckpointError("holds neither *.safetensors files nor an orbax checkpoint", file=path)
    return SAFETENSORS


def open_checkpoint(path: str) -> StoredTensors:
    """The tensors of an HF safetensors directory or of a `jspec convert` orbax directory."""
    if checkpoint_storage(path) == ORBAX:
        # `jspec convert` keeps `mtp.*` under their HF names; orbax restores the whole item.
        flat = orbax_io.load_params(path)
        return StoredTensors(flat.__getitem__, lambda n: flat[n].shape, list(flat))
    ckpt = SafetensorsCheckpoint(path)
    return StoredTensors(ckpt.get, ckpt.shape, ckpt.names())


class TensorView:
    """The drafter's tensors of a checkpoint under the drafter module's names.

    stored: module name -> stored name, for the tensors that belong to the drafter (the format
    module chooses them); prefix: what the stored names add to the module's (`mtp.`, `model.` or
    nothing), used to name a tensor the checkpoint lacks as it would have been stored.
    """

    def __init__(self, stored_tensors: StoredTensors, stored: dict[str, str], prefix: str):
        self._get, self._shape = stored_tensors.get, stored_tensors.shape
        self._stored, self.prefix = stored, prefix

    def names(self) -> list[str]:
        return sorted(self._stored)

    def __contains__(self, name) -> bool:
        return name in self._stored

    def get(self, name: str) -> np.ndarray:
        return self._get(self._stored[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shape(self._stored[name]))

    def stored(self, name: str) -> str:
        """The stored name of module name `name` (for an absent one: as it would be stored)."""
        return self._stored.get(name, self.prefix + name)

    def take(self, name: str) -> np.ndarray | None:
        """Remove a tensor that is read by hand (EAGLE3's d2t) from the view, so the mapping does
        not report it as unexpected; None when absent."""
        if name not in self._stored:
            return None
        arr = self.get(name)
        del self._stored[name]
        return arr


def head_tensors(path: str, drop: tuple[str, ...] = ()) -> TensorView:
    """A draft head's own directory (EAGLE, EAGLE3, DFlash): names without `model.`, though some
    writers add it, so both are read; a name stored both ways is refused rather than guessed.

    drop: module names the format ignores (a shipped copy of the target's embedding or lm_head).
    """
    stored_tensors = open_checkpoint(path)
    stored = {}
    prefixed = any(n.startswith("model.") for n in stored_tensors.names)
    for n in stored_tensors.names:
        name = n[len("model."):] if n.startswith("model.") else n
        if name in drop:
            continue
        if name in stored:
            raise CheckpointError("stored both with and without the `model.` prefix", tensor=n)
        stored[name] = n
    return TensorView(stored_tensors, stored, "model." if prefixed else "")


def renamed_error(e: CheckpointError, view: TensorView) -> CheckpointError:
    """`e` with its tensor (a module name) replaced by the stored name, in the message too."""
    if e.tensor is None:
        return e
    stored = view.stored(e.tensor)
    out = CheckpointError(str(e).replace(f"tensor {e.tensor!r}", f"tensor {stored!r}", 1))
    out.tensor, out.file = stored, e.file
    return out


def read_params(view: TensorView, expected: dict[str, tuple], dt) -> dict[str, np.ndarray]:
    """Every tensor of `expected` (module name -> shape) from `view`, as host arrays in `dt`.

    Raises CheckpointError, under the stored name, for a tensor that is missing, unexpected (in
    the view but not expected) or mis-shaped.
    """
    try:
        params, _ = hf_mapping.load_params(view, expected, dtype=np.dtype(dt))
    except CheckpointError as e:
        raise renamed_error(e, view) from None
    return params


# ----------------------------------------------------------------------------- config.json


def read_config_json(path: str) -> dict:
    """The parsed config.json of a draft directory; ConfigError when it is absent or not JSON."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise ConfigError(f"no config.json in draft model path {path!r}")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None


# ----------------------------------------------------------------------------- building


def filled_state(state: nnx.State, flat: dict) -> nnx.State:
    """A copy of the abstract `state` with every leaf from `flat` (module name -> array), in the
    leaf's own dtype: the parameters' dtype, int32 for a token map such as d2t."""
    def fill(path, leaf):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return jnp.asarray(flat[name], dtype=leaf.dtype)

    filled = jax.tree_util.tree_map_with_path(fill, state.to_pure_dict())
    new_state = jax.tree_util.tree_map(lambda x: x, state)
    nnx.replace_by_pure_dict(new_state, filled)
    return new_state


def build_draft_model(kind: str, make: Callable[[], Drafter],
                      flat_fn: Callable[[dict[str, tuple]], dict[str, np.ndarray]], dt, path: str) -> DraftModel:
    """Create the module `make()` abstractly, then fill it from `flat_fn(expected)`, where
    expected maps every module name to its shape: the module, not the checkpoint, says which
    tensors there must be. kind: `Drafter.kind`; path: recorded on the DraftModel."""
    module = nnx.eval_shape(make)
    graphdef, abstract = nnx.split(module)
    flat = flat_fn(flat_names(abstract))
    return DraftModel(kind=kind, config=module.config, graphdef=graphdef, params=filled_state(abstract, flat),
                      dtype=dt, path=path, capture_layers=tuple(module.capture_layers),
                      block_size=getattr(module, "block_size", None))


NORM_SUFFIXES = ("norm.weight", "norm_embedding.weight", "norm_hidden.weight")


def random_params(expected: dict[str, tuple], rng: np.random.Generator, scale: float, *, zero_centred_norm: bool,
                  fixed: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Random host weights for `expected` (module name -> shape): norms at their identity (0 for
    zero-centred norms, else 1), other tensors normal with std `scale`, and `fixed` (e.g. d2t)
    as given. Drawn with numpy, in sorted name order so a seed gives the same weights: one numpy
    call per tensor, where jax.random would compile per shape."""
    fixed = fixed or {}
    out = {}
    for name, shp in sorted(expected.items()):
        if name in fixed:
            out[name] = fixed[name]
        elif name.endswith(NORM_SUFFIXES):
            out[name] = np.full(shp, 0.0 if zero_centred_norm else 1.0, np.float32)
        else:
            out[name] = scale * rng.standard_normal(shp, dtype=np.float32)
    return out
