"""Saving and loading a flat dict of parameters as an orbax checkpoint.

Layout: `out_dir/params` is the orbax item, so config.json and the tokenizer
files can sit beside it in `out_dir`.

Names such as `model.layers.0.self_attn.q_proj.weight` are stored as they are, as
the keys of a one-level dict. Orbax keeps each key whole in its tree metadata
(`('model.layers.0.q_proj.weight',)`) and names the array in its store by joining
the key path with dots, which for a one-level dict is the name itself; so dotted
names, and names that are prefixes of one another, need no escaping (tests check
both).

Only APIs present in orbax-checkpoint 0.12.4 are used (PyTreeCheckpointer,
args.PyTreeSave / PyTreeRestore, RestoreArgs, metadata().item_metadata.tree).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from tqdm import tqdm

from checkpoints.errors import CheckpointError

PARAMS_ITEM = "params"
META_FILE = "jspec_checkpoint.json"  # beside the item: source, dtype, tensor count, tp_size of the layout
# Written by orbax's PyTree handler once the item is complete; an unfinished save
# lives in a `params.orbax-checkpoint-tmp-*` folder and is renamed at the end.
_TREE_METADATA_FILE = "_METADATA"


def is_orbax_dir(directory: str | os.PathLike) -> bool:
    """True if `directory` holds a finished params checkpoint written by save_params."""
    return (Path(directory) / PARAMS_ITEM / _TREE_METADATA_FILE).is_file()


def save_params(params: Mapping[str, object], out_dir: str | os.PathLike, *, progress: bool = True) -> None:
    """Write `params` (flat: name -> numpy or jax array) to `out_dir/params`; returns when it is on disk."""
    import orbax.checkpoint as ocp  # slow import (pulls in jax and tensorstore); only when used

    item_dir = Path(out_dir).resolve() / PARAMS_ITEM
    if item_dir.exists():
        raise CheckpointError("already exists; remove it or pick another out_dir", file=str(item_dir))

    # Gather everything to host numpy first: orbax then writes plain arrays whose
    # metadata says np.ndarray (no device sharding recorded), so load_params gets
    # host arrays back on any machine, with or without the devices that made them.
    host: dict[str, np.ndarray] = {}
    for name, value in tqdm(params.items(), total=len(params), desc="gathering params",
                            unit="tensor", disable=not progress):
        if not isinstance(name, str):
            raise CheckpointError(f"parameter names must be strings, got {type(name).__name__}", tensor=repr(name))
        array = np.asarray(value)
        if array.dtype == object:
            raise CheckpointError(f"is not a numeric array ({type(value).__name__})", tensor=name)
        if array.size == 0:
            # orbax refuses zero-size arrays ("Cannot save arrays with zero size").
            raise CheckpointError(f"has zero elements (shape {array.shape}); orbax cannot store it", tensor=name)
        host[name] = array

    item_dir.parent.mkdir(parents=True, exist_ok=True)
    # PyTreeCheckpointer is orbax's synchronous Checkpointer (it has no
    # wait_until_finished): save() returns only after the item is written and
    # renamed into place, so the checkpoint is finished when we return.
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        checkpointer.save(item_dir, args=ocp.args.PyTreeSave(host))
    finally:
        checkpointer.close()


def read_meta(directory: str | os.PathLike) -> dict:
    """The META_FILE written beside the params by `jspec convert` ({} when there is none)."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def load_params(directory: str | os.PathLike, shardings: Mapping | None = None) -> dict:
    """Read back what save_params wrote in `directory`, as host numpy arrays; tensors named in
    `shardings` (name -> jax.sharding.Sharding) are restored straight onto their devices instead,
    each device reading only its own slice from the store."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    if not is_orbax_dir(directory):
        raise CheckpointError(
            f"not an orbax params checkpoint: no {PARAMS_ITEM}/{_TREE_METADATA_FILE} in it", file=str(directory)
        )
    item_dir = directory / PARAMS_ITEM
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        tree = checkpointer.metadata(item_dir).item_metadata.tree
        if not isinstance(tree, Mapping) or any(isinstance(v, Mapping) for v in tree.values()):
            raise CheckpointError("holds a nested tree, not a flat dict of parameters", file=str(item_dir))
        # Ask for numpy explicitly: otherwise orbax follows the saved metadata and,
        # for a checkpoint written from jax arrays, would rebuild sharded device arrays.
        shardings = shardings or {}
        restore_args = {name: (ocp.ArrayRestoreArgs(sharding=shardings[name]) if name in shardings
                               else ocp.RestoreArgs(restore_type=np.ndarray)) for name in tree}
        restored = checkpointer.restore(item_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except CheckpointError:
        raise
    except Exception as e:  # orbax and tensorstore raise many kinds; say which checkpoint failed
        raise CheckpointError(f"cannot restore orbax params: {type(e).__name__}: {e}", file=str(directory)) from e
    finally:
        checkpointer.close()
    return {name: value if name in shardings else np.asarray(value) for name, value in restored.items()}
