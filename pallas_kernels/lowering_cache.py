"""One Triton lowering per distinct kernel per process, shared by every compiled step that calls it.

JAX lowers each `pallas_call` of a module to a Triton module afresh, and caches nothing between
modules. An engine lowers dozens of steps whose kernels repeat exactly: a decode bucket and its
sampler twin run the same forward, and the memory plan lowers the largest buckets once more. The
Triton lowering is plain Python (a new MLIR context, then the kernel's jaxpr op by op), the
serial main-thread part of a start-up that the compiles on the pool wait for.

`install()` wraps JAX's Triton lowering of a kernel in a memo keyed by everything the lowered
module is a function of, the lowering's arguments as this jax names them: the kernel's jaxpr as
printed (its equations, their parameters and the literal values) with its name and source, the
grid mapping (block shapes, index maps, grid), the platform, the compute capability, and of the
enclosing module its axis context; a call whose arguments do not bind to that signature goes to
JAX unmemoized. A kernel whose jaxpr closes over constant arrays is not memoized (their values are
not in the printed jaxpr), nor one whose lowering registers host callbacks or keep-alive objects
with the enclosing module (a memo hit would leave them out of the next module). The lowered
result holds its module in its own MLIR context, which the caller only reads (writes it out as
bytecode), so one result serves every module that asks. `JSPEC_PALLAS_LOWERING_CACHE=0` before
the first engine of a process leaves JAX's lowering as it is.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading

ENV = "JSPEC_PALLAS_LOWERING_CACHE"

_lock = threading.Lock()
_memo: dict[tuple, object] = {}
stats = {"hits": 0, "misses": 0, "uncached": 0}
_UNCACHEABLE = object()  # the memo's entry for a kernel that must be lowered every time


def _key(arguments: dict) -> tuple | None:
    """The memo key of one call's bound arguments (whatever this jax's signature names them), or
    None where a kernel cannot be memoized."""
    key = []
    for name, value in arguments.items():
        if name == "jaxpr":
            if getattr(value, "consts", None):
                return None
            info = getattr(value, "debug_info", None)
            key += [str(value), getattr(info, "func_name", None), getattr(info, "func_src_info", None)]
        elif name == "mlir_ctx":
            key.append(repr(getattr(value, "axis_context", None)))
        else:
            key.append((name, repr(value)))
    return tuple(key)


def _registered(mlir_ctx) -> int:
    """How many host callbacks and keep-alives the enclosing module holds."""
    return sum(len(getattr(mlir_ctx, name, None) or ()) for name in ("host_callbacks", "keepalives"))


def _memoized(lower):
    signature = inspect.signature(lower)

    @functools.wraps(lower)
    def wrapper(*args, **kwargs):
        try:
            arguments = signature.bind(*args, **kwargs).arguments
            key = _key(arguments)
        except TypeError:  # a call this wrapper does not understand: JAX's own lowering
            arguments, key = {}, None
        with _lock:
            hit = None if key is None else _memo.get(key)
        if key is None or hit is _UNCACHEABLE:
            stats["uncached"] += 1
            return lower(*args, **kwargs)
        if hit is not None:
            stats["hits"] += 1
            return hit
        mlir_ctx = arguments.get("mlir_ctx")
        before = _registered(mlir_ctx)
        result = lower(*args, **kwargs)
        with _lock:
            _memo.setdefault(key, result if _registered(mlir_ctx) == before else _UNCACHEABLE)
        stats["misses"] += 1
        return result

    wrapper.jspec_memoized = True
    return wrapper


def install() -> bool:
    """Memoize JAX's Triton lowering of Pallas kernels for this process (once; a no-op when
    `JSPEC_PALLAS_LOWERING_CACHE=0` or this jax has no Triton lowering) -> whether it is on."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:
        return False
    lowering = getattr(registration, "lowering", None)
    lower = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if lower is None:
        return False
    if not getattr(lower, "jspec_memoized", False):
        lowering.lower_jaxpr_to_triton_module = _memoized(lower)
    return True


def take() -> dict:
    """The counters since the last take, then forget every memoized lowering: an engine takes
    them once its steps are compiled, so the memo's MLIR contexts do not outlive start-up."""
    with _lock:
        _memo.clear()
        counts = dict(stats)
        stats.update(hits=0, misses=0, uncached=0)
    return counts
