"""Build a model from a checkpoint directory (Hugging Face safetensors or converted orbax).

The module is created abstractly (`nnx.eval_shape`, no memory), split once into a static graph
definition and a flat parameter state, and the state is filled from the checkpoint. Steps later
re-merge graphdef and state inside `jax.jit`, so every step is a pure function of its arrays.

With a tensor-parallel mesh (`tp_size` > 1) each tensor is put into the split layout on the host
(`jspec.sharding.to_tp_layout`) and every device receives only its own slice, straight from the
host array (memory-mapped for safetensors): no device ever holds a whole split tensor.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from checkpoints import hf_mapping, orbax_io
from checkpoints.safetensors_reader import SafetensorsCheckpoint
from jspec.cache import memory
from jspec.config import ModelConfig, load_config
from jspec.errors import CheckpointError, ConfigError
from jspec.models.causal_lm import CausalLM
from jspec.sharding import check_tp, from_tp_layout, make_mesh, mixer_tp, param_spec, path_name, to_tp_layout

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


def abstract_model(config: ModelConfig, dtype, tp_size: int = 1, expert_parallel: bool = False,
                   replicate_attention: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and abstract (shape-only) parameter state of the target model (split
    tp_size ways: padded vocabulary, replicated KV heads, shard-major fused projections)."""
    model = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, tp_size=tp_size, expert_parallel=expert_parallel,
                                            replicate_attention=replicate_attention))
    return nnx.split(model)


def flat_names(state: nnx.State) -> dict[str, tuple]:
    """jspec parameter name (dotted path) -> shape, for every leaf of a state."""
    out = {}
    for path, leaf in state.flat_state():
        out[".".join(str(p) for p in path)] = tuple(leaf.get_value().shape)
    return out


def _with_leaves(state: nnx.State, leaf) -> nnx.State:
    """A copy of `state` whose leaf at each path is `leaf(name)` (name: the dotted parameter path)."""
    filled = jax.tree_util.tree_map_with_path(lambda path, _: leaf(path_name(path)), state.to_pure_dict())
    new_state = jax.tree_util.tree_map(lambda x: x, state)
    nnx.replace_by_pure_dict(new_state, filled)
    return new_state


def fill_state(state: nnx.State, flat: dict, dtype, *, config: ModelConfig | None = None, mesh=None,
               ep: bool = False, replicate_attention: bool = False) -> nnx.State:
    """A copy of `state` with every leaf replaced by `flat[name]` (tp = 1 layout), placed on the
    default device, or, with a mesh, put in the mesh's split layout and placed slice by slice."""
    if mesh is None:
        return _with_leaves(state, lambda name: jnp.asarray(flat[name], dtype=dtype))

    def place(name):
        arr = to_tp_layout(name, np.asarray(flat[name]), config, mesh.size, ep=ep,
                           replicate_attention=replicate_attention)
        sharding = NamedSharding(mesh, param_spec(name, ep=ep, replicate_attention=replicate_attention))
        return jax.make_array_from_callback(arr.shape, sharding, lambda idx: np.asarray(arr[idx], dtype=dtype))

    return _with_leaves(state, place)


def state_to_flat(state: nnx.State) -> dict[str, jax.Array]:
    return {".".join(str(p) for p in path): leaf.get_value() for path, leaf in state.flat_state()}


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))


def read_params(path: str, config: ModelConfig, dtype, *, progress=None, mesh=None, ep: bool = False,
                replicate_attention: bool = False) -> tuple[dict, dict, bool]:
    """(params: name -> array in `dtype`, extras: names set aside such as `mtp.*`, placed).

    Arrays are host arrays in the tp = 1 layout, except for an orbax checkpoint converted for the
    mesh's split (`jspec convert --tp-size N`): then every tensor is restored straight onto the
    mesh in that layout, each device reading its own slice, and `placed` is True."""
    np_dtype = np.dtype(dtype)
    if orbax_io.is_orbax_dir(path):
        meta = orbax_io.read_meta(path)
        stored_tp, stored_ep = int(meta.get("tp_size", 1)), bool(meta.get("expert_parallel", False))
        stored_rep = bool(meta.get("replicate_attention", False))
        same_split = (stored_ep, stored_rep) == (ep, replicate_attention)
        placed = mesh is not None and mesh.size == stored_tp > 1 and same_split
        expected = flat_names(abstract_model(config, dtype, stored_tp, stored_ep, stored_rep)[1])
        shardings = {n: NamedSharding(mesh, param_spec(n, ep=ep, replicate_attention=replicate_attention))
                     for n in expected} if placed else None
        flat = orbax_io.load_params(path, shardings)
        params = {k: v for k, v in flat.items() if not k.startswith(hf_mapping.EXTRA_PREFIXES)}
        extras = {k: k for k in flat if k.startswith(hf_mapping.EXTRA_PREFIXES)}
        for name in sorted(set(expected) - set(params)):
            raise CheckpointError("missing tensor", tensor=name)
        for name in sorted(set(params) - set(expected)):
            raise CheckpointError("unexpected tensor", tensor=name)
        for name, shape in expected.items():
            if tuple(params[name].shape) != shape:
                raise CheckpointError(f"shape {tuple(params[name].shape)} does not match expected {shape}"
                                      + (f" (stored for tp_size={stored_tp})" if stored_tp > 1 else ""), tensor=name)
            if params[name].dtype != np_dtype:
                params[name] = params[name].astype(np_dtype)
            if not placed:
                params[name] = from_tp_layout(name, params[name], config, stored_tp, ep=stored_ep,
                                              replicate_attention=stored_rep)
        return params, extras, placed
    if not is_hf_dir(path):
        raise CheckpointError(f"{path!r} holds neither safetensors files nor an orbax checkpoint", file=path)
    ckpt = SafetensorsCheckpoint(path)
    _, abstract = abstract_model(config, dtype)
    expected = flat_names(abstract)
    params, extras = hf_mapping.load_params(ckpt, expected, weight_prefix=config.weight_prefix,
                                            tied_lm_head=config.tie_word_embeddings, dtype=np_dtype, progress=progress)
    return params, extras, False


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
    tp_size: int = 1
    mesh: object = None  # the jax.sharding.Mesh the parameters live on when tp_size > 1
    expert_parallel: bool = False  # MoE experts split whole over the mesh (ep_size = tp_size)
    replicate_attention: bool = False  # attention / GDN layers and their pools whole on every device
    # the ways the token mixers and the KV / state pools are split (`jspec.sharding.mixer_tp`); a
    # field set once at construction
    mixer_tp_size: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.mixer_tp_size = mixer_tp(self.tp_size, self.replicate_attention)

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


def load_model(path: str | os.PathLike, dtype="float32", *, progress=None, tp_size: int = 1,
               expert_parallel: bool = False, replicate_attention: bool = False) -> Model:
    """Load an HF (safetensors) or orbax (`jspec convert`) checkpoint directory, split over the
    first tp_size devices when tp_size > 1 (ConfigError before any tensor is read if it cannot be);
    expert_parallel: MoE experts split whole rather than by their intermediate dimension;
    replicate_attention: attention and GDN layers kept whole on every device (`jspec.sharding`)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} is not a directory")
    config = load_config(path)
    dt = resolve_dtype(dtype)
    tp = check_tp(config, tp_size, ep=expert_parallel, replicate_attention=replicate_attention)
    ep, rep = expert_parallel and tp > 1, replicate_attention and tp > 1
    mesh = make_mesh(tp) if tp > 1 else None
    memory.note_outside_allocator()
    params, extras, placed = read_params(path, config, dt, progress=progress, mesh=mesh, ep=ep, replicate_attention=rep)
    graphdef, abstract = abstract_model(config, dt, tp, ep, rep)
    if placed:
        state = _with_leaves(abstract, lambda name: params[name])
    else:
        state = fill_state(abstract, params, dt, config=config, mesh=mesh, ep=ep, replicate_attention=rep)
    return Model(config=config, graphdef=graphdef, params=state, dtype=dt, path=path,
                 tokenizer=load_tokenizer(path), extras=extras, tp_size=tp, mesh=mesh, expert_parallel=ep,
                 replicate_attention=rep)


def shard_model(model: Model, tp_size: int, *, expert_parallel: bool = False,
                replicate_attention: bool = False) -> Model:
    """A copy of an unsplit model split over the first tp_size devices (the original is kept).
    Goes through host memory: for tests and small models; large ones load split (`load_model`)."""
    if model.tp_size != 1:
        raise ConfigError(f"shard_model takes an unsplit model; this one has tp_size={model.tp_size}")
    tp = check_tp(model.config, tp_size, ep=expert_parallel, replicate_attention=replicate_attention)
    if tp == 1:
        return model
    flat = {k: np.asarray(v) for k, v in state_to_flat(model.params).items()}
    mesh = make_mesh(tp)
    graphdef, abstract = abstract_model(model.config, model.dtype, tp, expert_parallel, replicate_attention)
    state = fill_state(abstract, flat, model.dtype, config=model.config, mesh=mesh, ep=expert_parallel,
                       replicate_attention=replicate_attention)
    return dataclasses.replace(model, graphdef=graphdef, params=state, tp_size=tp, mesh=mesh,
                               expert_parallel=expert_parallel, replicate_attention=replicate_attention)


def _random_leaf(name: str, shape, dtype, config: ModelConfig, scale: float):
    """(kind, initialiser) of one random parameter; the initialiser is a function of its key."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        if config.zero_centred_norm and not name.endswith("linear_attn.norm.weight"):
            return "zeros", lambda k: jnp.zeros(shape, dtype)
        return "ones", lambda k: jnp.ones(shape, dtype)
    if name.endswith("A_log"):
        return "A_log", lambda k: jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
    if name.endswith("dt_bias"):
        return "ones", lambda k: jnp.ones(shape, dtype)
    return "normal", lambda k: (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)


def random_model(config: ModelConfig, dtype="bfloat16", seed: int = 0, scale: float = 0.02, *,
                 tp_size: int = 1, expert_parallel: bool = False, replicate_attention: bool = False) -> Model:
    """A model with random weights (benchmarks of real shapes without a real checkpoint). Split
    tp_size ways, each device draws its own slices (nothing whole passes through one device); the
    weights then differ from the unsplit model's of the same seed."""
    dt = resolve_dtype(dtype)
    tp = check_tp(config, tp_size, ep=expert_parallel, replicate_attention=replicate_attention)
    ep, rep = expert_parallel and tp > 1, replicate_attention and tp > 1
    mesh = make_mesh(tp) if tp > 1 else None
    graphdef, abstract = abstract_model(config, dt, tp, ep, rep)
    memory.note_outside_allocator()
    key = jax.random.PRNGKey(seed)
    index = {name: i for i, name in enumerate(sorted(flat_names(abstract)))}
    shapes = flat_names(abstract)
    jitted = {}

    def make(name):
        kind, init = _random_leaf(name, shapes[name], dt, config, scale)
        k = jax.random.fold_in(key, index[name])
        if mesh is None:
            return init(k)
        sharding = NamedSharding(mesh, param_spec(name, ep=ep, replicate_attention=rep))
        sig = (kind, shapes[name], sharding)  # one compile per kind, shape and split
        if sig not in jitted:
            jitted[sig] = jax.jit(init, out_shardings=sharding)
        return jitted[sig](k)

    state = _with_leaves(abstract, make)
    return Model(config=config, graphdef=graphdef, params=state, dtype=dt, path="<random>", tp_size=tp, mesh=mesh,
                 expert_parallel=ep, replicate_attention=rep)
