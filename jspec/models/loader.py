"""Build a model from a checkpoint directory (Hugging Face safetensors or converted orbax).

The module is created abstractly (`nnx.eval_shape`, no memory), split once into a static graph
definition and a flat parameter state, and the state is filled from the checkpoint. Steps later
re-merge graphdef and state inside `jax.jit`, so every step is a pure function of its arrays.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints import hf_mapping, orbax_io
from checkpoints.safetensors_reader import SafetensorsCheckpoint
from jspec.config import ModelConfig, load_config
from jspec.errors import CheckpointError, ConfigError
from jspec.models.causal_lm import CausalLM

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype == "auto":
            dtype = "bfloat16"
        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not supported (choose from {sorted(DTYPES)})")
        return jnp.dtype(DTYPES[dtype])
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise ConfigError(f"dtype={dtype!r} is not a dtype") from None
    if d not in [jnp.dtype(v) for v in DTYPES.values()]:
        raise ConfigError(f"dtype={dtype!r} is not supported (choose from {sorted(DTYPES)})")
    return d


def abstract_model(config: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and abstract (shape-only) parameter state of the target model."""
    model = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype))
    return nnx.split(model)


def flat_names(state: nnx.State) -> dict[str, tuple]:
    """jspec parameter name (dotted path) -> shape, for every leaf of a state."""
    out = {}
    for path, leaf in state.flat_state():
        out[".".join(str(p) for p in path)] = tuple(leaf.get_value().shape)
    return out


def fill_state(state: nnx.State, flat: dict, dtype) -> nnx.State:
    """A copy of `state` with every leaf replaced by `flat[name]` placed on the default device."""
    pure = state.to_pure_dict()

    def fill(path, _):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        arr = flat[name]
        return jnp.asarray(arr, dtype=dtype)

    filled = jax.tree_util.tree_map_with_path(fill, pure)
    new_state = jax.tree_util.tree_map(lambda x: x, state)
    nnx.replace_by_pure_dict(new_state, filled)
    return new_state


def state_to_flat(state: nnx.State) -> dict[str, jax.Array]:
    return {".".join(str(p) for p in path): leaf.get_value() for path, leaf in state.flat_state()}


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))


def read_params(path: str, config: ModelConfig, dtype, *, progress=None) -> tuple[dict, dict]:
    """(params: name -> host array in `dtype`, extras: names set aside such as `mtp.*`)."""
    _, abstract = abstract_model(config, dtype)
    expected = flat_names(abstract)
    np_dtype = np.dtype(dtype)
    if orbax_io.is_orbax_dir(path):
        flat = orbax_io.load_params(path)
        params = {k: v for k, v in flat.items() if not k.startswith(hf_mapping.EXTRA_PREFIXES)}
        extras = {k: k for k in flat if k.startswith(hf_mapping.EXTRA_PREFIXES)}
        for name in sorted(set(expected) - set(params)):
            raise CheckpointError("missing tensor", tensor=name)
        for name in sorted(set(params) - set(expected)):
            raise CheckpointError("unexpected tensor", tensor=name)
        for name, shape in expected.items():
            if tuple(params[name].shape) != shape:
                raise CheckpointError(f"shape {tuple(params[name].shape)} does not match expected {shape}",
                                      tensor=name)
            if params[name].dtype != np_dtype:
                params[name] = params[name].astype(np_dtype)
        return params, extras
    if not is_hf_dir(path):
        raise CheckpointError(f"{path!r} holds neither safetensors files nor an orbax checkpoint", file=path)
    ckpt = SafetensorsCheckpoint(path)
    return hf_mapping.load_params(
        ckpt,
        expected,
        weight_prefix=config.weight_prefix,
        tied_lm_head=config.tie_word_embeddings,
        dtype=np_dtype,
        progress=progress,
    )


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from `tokenizer.json`, or None when the directory has none."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file)


@dataclasses.dataclass
class Model:
    """A loaded target model: configuration, graph definition, parameters, tokenizer."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: jnp.dtype
    path: str
    tokenizer: object = None
    extras: dict = dataclasses.field(default_factory=dict)

    def module(self) -> CausalLM:
        """Re-merge into a module (inside a traced function, or for inspection)."""
        return nnx.merge(self.graphdef, self.params)

    def num_parameters(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self.params))

    def num_bytes(self) -> int:
        return sum(int(x.size * x.dtype.itemsize) for x in jax.tree_util.tree_leaves(self.params))

    def score(self, token_ids) -> np.ndarray:
        """Next-token logits `[T, V]` (float32 numpy) for one sequence, run through the paged cache."""
        from jspec.models.scoring import score_sequence

        return score_sequence(self, token_ids)


def load_model(path: str | os.PathLike, dtype="float32", *, progress=None) -> Model:
    """Load an HF (safetensors) or orbax (`jspec convert`) checkpoint directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} is not a directory")
    config = load_config(path)
    dt = resolve_dtype(dtype)
    params, extras = read_params(path, config, dt, progress=progress)
    graphdef, abstract = abstract_model(config, dt)
    state = fill_state(abstract, params, dt)
    return Model(config=config, graphdef=graphdef, params=state, dtype=dt, path=path,
                 tokenizer=load_tokenizer(path), extras=extras)


def random_model(config: ModelConfig, dtype="bfloat16", seed: int = 0, scale: float = 0.02) -> Model:
    """A model with random weights (benchmarks of real shapes without a real checkpoint)."""
    dt = resolve_dtype(dtype)
    graphdef, abstract = abstract_model(config, dt)
    names = flat_names(abstract)
    key = jax.random.PRNGKey(seed)
    flat = {}
    for i, (name, shape) in enumerate(sorted(names.items())):
        k = jax.random.fold_in(key, i)
        if name.endswith(("norm.weight", "layernorm.weight")):
            flat[name] = (jnp.zeros if config.zero_centred_norm and not name.endswith("linear_attn.norm.weight")
                          else jnp.ones)(shape, dt)
        elif name.endswith("A_log"):
            flat[name] = jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0)).astype(dt)
        elif name.endswith("dt_bias"):
            flat[name] = jnp.ones(shape, dt)
        else:
            flat[name] = (scale * jax.random.normal(k, shape, jnp.float32)).astype(dt)
    state = fill_state(abstract, flat, dt)
    return Model(config=config, graphdef=graphdef, params=state, dtype=dt, path="<random>")
