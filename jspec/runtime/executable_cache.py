"""Compiled steps kept on disk, so that a warm start neither traces nor lowers them.

XLA's persistent compilation cache is keyed by the lowered program: a warm start skips XLA's
compiler but still traces and lowers every bucket in Python first, and that is most of a warm
start's time. This cache is keyed by what a step's program is made from instead:

- the code that traces it: the source files of `jspec` and `pallas_kernels`, and every function
  (its bytecode, constants and the names it reads), class and scalar constant of their modules
  that can build a step, as they are in memory, so an edited file or a patched function changes
  the key (`code_digest`). Those modules are all imported first, and the front ends (server,
  benchmarks, training, command line) are left out of the in-memory part, so what else a process
  happened to import (`jspec serve` imports the server before its engine starts) does not;
- the jax and jaxlib versions, the platform, device kinds and ids, `XLA_FLAGS`, the kernel backend
  and the jax settings that change lowering;
- the engine's resolved settings, the target's and drafter's configuration and module structure
  (`context`, given by the engine);
- the bucket and the abstract arguments: every parameter's and state leaf's shape, dtype and
  sharding (`abstract_signature`).

A hit deserializes the executables (`jax.experimental.serialize_executable`); an entry that fails
to load is compiled again and rewritten. On CPU a step that XLA's own persistent cache served is
not stored: re-serializing an executable JAX loaded from that cache can give a payload that loads
but fails when run (jax 0.10: "Function ... not found"), so such a step goes through XLA's cache
again at the next start. GPU executables survive that round trip (`bench/executable_cache_roundtrip.py`)
and are stored whichever cache served them (`stores_served`). Writes are atomic (a temporary file
renamed), so engines starting side by side share the folder. Loading a serialized executable can run code: the folder
must be as trusted as the code itself (it is the user's own cache directory).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pickle
import pkgutil
import sys
import tempfile
import threading
import types

import jax
import jax.monitoring
import jaxlib
from jax.experimental import serialize_executable

from jspec.models import dispatch
from jspec.runtime.compile_options import (GRAPH_COLLECTIVES_ENV, PROMPT_MATMULS_ENV, STATIC_CARRY_ENV,
                                           UNCAPTURED_PARTS_ENV, UPDATE_MODE_ENV)
from jspec.runtime.slim_part import SlimPart

log = logging.getLogger(__name__)

_PACKAGES = ("jspec", "pallas_kernels")
# Modules that never build a step: their files are in the digest, their memory is not.
_FRONT_ENDS = ("jspec.server", "jspec.bench", "jspec.train", "jspec.cli", "jspec.demo", "jspec.tiny",
               "jspec.convert")
_SCALARS = (int, float, str, bool, bytes, type(None))


def _scalar_tree(value) -> bool:
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, (tuple, frozenset)) and all(_scalar_tree(v) for v in value)


def _canonical(value) -> str:
    """repr of a scalar tree with sets in sorted order: a set's iteration order follows string
    hashes, which differ between processes (`in {...}` tests compile to frozenset constants, and
    Python 3.12 writes one into every frozen dataclass's `__setattr__`)."""
    if isinstance(value, frozenset):
        return "frozenset({" + ", ".join(sorted(map(_canonical, value))) + "})"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_canonical, value)) + ",)"
    return repr(value)


def _feed_code(h, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _feed_code(h, const)
        elif _scalar_tree(const):
            h.update(_canonical(const).encode())


def _feed(h, name: str, value, module: str, depth: int = 0) -> None:
    value = getattr(value, "__wrapped__", value)  # jax.jit, functools.wraps and lru_cache wrappers
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        value = value.fget
    if isinstance(value, types.FunctionType):
        h.update(name.encode())
        _feed_code(h, value.__code__)
        if value.__defaults__ and _scalar_tree(value.__defaults__):
            h.update(_canonical(value.__defaults__).encode())
    elif isinstance(value, type) and depth == 0 and value.__module__ == module:
        h.update(name.encode())
        for key, member in sorted(vars(value).items()):
            _feed(h, key, member, module, depth + 1)
    elif _scalar_tree(value):
        h.update(f"{name}={_canonical(value)}".encode())


def _front_end(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in _FRONT_ENDS)


@functools.cache
def step_modules() -> tuple[str, ...]:
    """Every module of the packages that can build a step (all but the front ends), imported: a
    fixed set, whatever the process imported before. One that cannot be imported here (a
    missing optional dependency) is left out."""
    names = list(_PACKAGES)
    todo = [(importlib.import_module(p).__path__, p) for p in _PACKAGES]
    while todo:
        path, prefix = todo.pop()
        for info in pkgutil.iter_modules(path, prefix + "."):
            if _front_end(info.name):
                continue
            names.append(info.name)
            if info.ispkg:
                todo.append(([os.path.join(p, info.name.rsplit(".", 1)[-1]) for p in path], info.name))
    loaded = []
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        loaded.append(name)
    return tuple(loaded)


def code_digest() -> str:
    """A digest of jspec's and pallas_kernels' source files and of the step-building modules'
    code as it is in memory now (`step_modules`)."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        root = os.path.dirname(importlib.import_module(package).__file__)
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(folder, f), "rb") as src:
                        h.update(os.path.relpath(os.path.join(folder, f), root).encode() + src.read())
    for name in step_modules():
        module = sys.modules.get(name)
        if module is None:
            continue
        h.update(name.encode())
        for key, value in sorted(vars(module).items()):
            _feed(h, key, value, name)
    return h.hexdigest()


def environment() -> str:
    """The jax side of a key: versions, devices, flags and the settings that change lowering."""
    devices = [(d.platform, getattr(d, "device_kind", ""), d.id) for d in jax.devices()]
    settings = {k: getattr(jax.config, k, None) for k in
                ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl")}
    return repr((jax.__version__, jaxlib.__version__, devices, os.environ.get("XLA_FLAGS", ""),
                 os.environ.get(GRAPH_COLLECTIVES_ENV, ""), os.environ.get(UNCAPTURED_PARTS_ENV, ""),
                 os.environ.get(STATIC_CARRY_ENV, ""), os.environ.get(UPDATE_MODE_ENV, ""),
                 os.environ.get(PROMPT_MATMULS_ENV, ""), dispatch.backend(), sorted(settings.items())))


def abstract_signature(tree) -> str:
    """Tree structure plus each leaf's shape, dtype and sharding (values excluded)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        parts.append(f"{getattr(x, 'shape', ())}/{getattr(x, 'dtype', type(x).__name__)}/{spec}")
    return "\n".join(parts)


def models_signature(params, mesh, models, *extra) -> str:
    """The part of a step's key that all of a runner's buckets share: the parameters' abstract
    signature, the mesh, each model's configuration and module structure, and `extra`."""
    return "\n".join([abstract_signature(params), str(mesh), *map(str, extra)] +
                     [f"{m.config!r}\n{m.graphdef}" for m in models])


_XLA_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # jax.monitoring's event for a persistent-cache hit
_thread_hits = threading.local()
_listener_lock = threading.Lock()
# An Event, not a bool: module-level scalars feed the code digest, and a flag that flips at the
# first compile would change every key after it.
_listener_on = threading.Event()


def _on_event(event: str, **_) -> None:
    if event == _XLA_CACHE_HIT:
        _thread_hits.count = getattr(_thread_hits, "count", 0) + 1


def xla_cache_hits() -> int:
    """How many compiles on this thread XLA's persistent cache has served (counted from the first
    call in the process): compare before and after a compile to learn where it came from."""
    with _listener_lock:
        if not _listener_on.is_set():
            jax.monitoring.register_event_listener(_on_event)
            _listener_on.set()
    return getattr(_thread_hits, "count", 0)


def stores_served(platform: str) -> bool:
    """Whether a step that XLA's persistent cache served may be stored (serialized again) on
    `platform`: not on CPU, whose reloaded executables can name functions their payload lacks."""
    return platform != "cpu"


def _load_one(serialized: tuple, plan, devices):
    """One stored executable loaded onto devices; a split step's part wrapped in its `SlimPart`."""
    exe = serialize_executable.deserialize_and_load(*serialized, execution_devices=devices)
    return exe if plan is None else SlimPart(exe, plan)


class ExecutableCache:
    """Serialized executables in `directory`, one file per key."""

    def __init__(self, directory: str, context: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._base = hashlib.sha256("\n".join((code_digest(), environment(), context)).encode()).hexdigest()
        self.hits = 0
        self.misses = 0

    def key(self, *parts: str) -> str:
        h = hashlib.sha256(self._base.encode())
        for p in parts:
            h.update(b"\0" + p.encode())
        return h.hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".jexe")

    def __contains__(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def load(self, key: str, devices) -> list | None:
        """The compiled executables stored under key, loaded onto `devices` (the program's devices
        in its order: the mesh's, not every visible one), or None (absent or unloadable)."""
        path = self._path(key)
        if not os.path.exists(path):
            self.misses += 1
            return None
        devices = list(devices)  # once: a mesh's `devices.flat` is an iterator, and a split step has several parts
        try:
            with open(path, "rb") as f:
                entries = pickle.load(f)
            exes = [_load_one(e, plan, devices) for e, plan in entries]
        except Exception as e:  # a stale or damaged entry: compile again and overwrite it
            log.warning("executable cache: %s did not load (%s: %s); compiling", path, type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return exes

    def recall(self, key: str) -> int | None:
        """A number stored under key by `remember` (an earlier start's pool size), or None."""
        try:
            with open(os.path.join(self.directory, key + ".int")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def remember(self, key: str, value: int) -> None:
        """Store a number under key (atomically); a folder that cannot be written only logs."""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(str(int(value)))
            os.replace(tmp, os.path.join(self.directory, key + ".int"))
        except OSError as e:
            log.warning("executable cache: %s not remembered (%s)", key, e)

    def discard(self, key: str) -> None:
        """Drop what is stored under key (a damaged entry that will not be rewritten)."""
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def store(self, key: str, executables: list) -> None:
        """Write the executables under key; one that cannot be serialized leaves no entry."""
        try:
            data = pickle.dumps([(serialize_executable.serialize(e.compiled), e.plan) if isinstance(e, SlimPart)
                                 else (serialize_executable.serialize(e), None) for e in executables])
        except Exception as e:
            log.warning("executable cache: not stored (%s: %s)", type(e).__name__, e)
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError as e:
            log.warning("executable cache: not stored (%s)", e)
            if os.path.exists(tmp):
                os.unlink(tmp)


def enable_compilation_cache(path: str | None) -> str | None:
    """Turn on XLA's persistent cache in path (default `JSPEC_COMPILATION_CACHE`, else
    ~/.cache/jspec/xla; "none": off); returns the folder or None."""
    path = path or os.environ.get("JSPEC_COMPILATION_CACHE", os.path.expanduser("~/.cache/jspec/xla"))
    if path in ("", "none"):
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path


def open_executable_cache(cache_dir: str | None, context: str) -> ExecutableCache | None:
    """Compiled steps beside XLA's cache in cache_dir, so a warm start skips tracing
    (`JSPEC_EXECUTABLE_CACHE=0`: off)."""
    if cache_dir is None or os.environ.get("JSPEC_EXECUTABLE_CACHE", "1") == "0":
        return None
    return ExecutableCache(os.path.join(cache_dir, "executables"), context)
