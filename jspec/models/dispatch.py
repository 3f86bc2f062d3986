"""How `ops` picks and runs an implementation: the kernel backend, and the map over tensor-parallel
devices.

Backends:
- "reference": the pure-jnp oracles in `pallas_kernels/<op>/reference.py` (CPU, tests);
- "pallas": the Pallas kernels (GPU);
- "interpret": the Pallas kernels in interpret mode (CPU tests of the kernel path).
The default is "pallas" on GPU and "reference" elsewhere; `JSPEC_KERNELS` or `set_backend` override
it. An operation with no Pallas kernel yet falls back to its reference, so every backend is complete.

Tensor parallelism: a layer of a target split over `tp` devices passes `tp=`; the kernel then runs
under `jax.shard_map` over the mesh set by `tensor_parallel` (the runner sets it while it traces),
seeing its device's heads (channels, expert slices) only. The rest of a step is partitioned by XLA
from the parameters' shardings; a custom kernel is opaque to XLA, hence the explicit map.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import jax
from jax.sharding import PartitionSpec as P

from jspec.sharding import TP

BACKENDS = ("reference", "pallas", "interpret")
_backend: str | None = None
_mesh = None  # the tensor-parallel mesh of the steps being traced (`tensor_parallel`)


def default_backend() -> str:
    env = os.environ.get("JSPEC_KERNELS")
    if env:
        if env not in BACKENDS:
            raise ValueError(f"JSPEC_KERNELS={env!r}: must be one of {BACKENDS}")
        return env
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def backend() -> str:
    return _backend or default_backend()


def set_backend(name: str | None) -> None:
    """Select the kernel backend for functions traced from now on (None: the default)."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def use_backend(name: str):
    prev = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(prev)


@contextlib.contextmanager
def tensor_parallel(mesh):
    """Trace under `mesh` (None: no mesh): layers with tp > 1 map their kernels over its `tp` axis."""
    global _mesh
    prev, _mesh = _mesh, mesh
    try:
        yield
    finally:
        _mesh = prev


def whole(x):
    """x kept whole on every device of the traced mesh (a sharding constraint; x itself without a
    mesh of several devices). For per-slot state that a step updates in place: left to itself,
    XLA may compute the update split over the vocabulary, as the logits beside it are, and then
    gather the whole buffer back every step."""
    if _mesh is None or _mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(_mesh, P()))


def per_device(fn, tp: int, in_specs, out_specs):
    """fn itself at tp == 1; else fn mapped over the mesh's tp axis with the given specs."""
    if tp == 1:
        return fn
    if _mesh is None or _mesh.shape.get(TP) != tp:
        raise RuntimeError(f"a layer split {tp} ways is traced without a {tp}-device mesh "
                           "(wrap the trace in jspec.models.dispatch.tensor_parallel(mesh))")
    return jax.shard_map(fn, mesh=_mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


# Specs by where the split axis sits: heads / channels of tokens `[T, H, ...]`, KV pages
# `[P, L, G, D]`, state pools `[S, H, ...]`, conv scratch `[B, N, C, K-1]`.
R = P()
TOK2, TOK3 = P(None, TP), P(None, TP, None)
PAGES = P(None, None, TP, None)
SSM = P(None, TP, None, None)


def kernel(module: str, name: str):
    """The Pallas implementation `pallas_kernels.<module>.<name>`, or None if not there yet."""
    try:
        mod = importlib.import_module(f"pallas_kernels.{module}")
    except ImportError:
        return None
    return getattr(mod, name, None)


def pick(module: str, name: str, ref):
    b = backend()
    if b == "reference":
        return ref, {}
    fn = kernel(module, name)
    if fn is None:
        return ref, {}
    return shared(fn), ({"interpret": True} if b == "interpret" else {})


def shared(fn):
    """A kernel entry point under one `jax.jit` per kernel, with every non-array keyword static:
    the layers of a step call each kernel with the same shapes and settings, so the kernel is
    traced and lowered once per step instead of once per layer (a Pallas kernel's lowering is
    most of a layer's trace-and-lower time). XLA inlines the call: the compiled step is the same."""
    def call(*args, **kw):
        static = tuple(sorted(k for k, v in kw.items() if not isinstance(v, jax.Array)))
        return _jit(fn, static)(*args, **kw)

    return call


@functools.lru_cache(maxsize=None)
def _jit(fn, static: tuple[str, ...]):
    return jax.jit(fn, static_argnames=static)
