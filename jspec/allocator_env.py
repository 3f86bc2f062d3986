"""The share of each GPU that JAX's allocator takes when it first touches the device, as importing
jspec sets it (`apply`, called by `jspec/__init__.py`). JAX's own
default is 75%, and `mem_fraction_static` is a share of what the allocator holds, so an engine
would use 0.88 x 0.75 = 66% of the device where SGLang's 0.88 means 88% of it. An engine owns
its GPUs: take 92% (what stays outside holds the CUDA context, NCCL's buffers and library
handles), unless the user chose.

`JSPEC_GRAMMAR_UPDATE_MODE` (`jspec/runtime/compile_options.py`) is honoured only by XLA's VMM
allocator, so setting it selects that allocator (`XLA_PYTHON_CLIENT_ALLOCATOR=vmm`) unless the user
chose one: the mode is then one setting, not two.

An engine with a grammar backend sets the mode to `SKIP_TEMP` itself (`choose_for_grammar`, called
before the engine first touches a device) where that is safe and measured: on a CUDA machine whose
JAX client does not exist yet, one device (tensor parallelism is not measured under the VMM
allocator), and neither the mode, the allocator nor XLA's own update-mode flag chosen by the user.
Otherwise a constrained speculative step's forward graph is re-recorded before nearly every
launch at small batches (its temporaries move), which costs the host milliseconds a step
(bench/README.md, "Structured output"). `JSPEC_GRAMMAR_UPDATE_MODE=` (empty) keeps XLA's default.

Effective only when jspec is imported before JAX first allocates on a GPU. A share or a
preallocation setting of the user's is kept (jaxlib reads the share as XLA_CLIENT_MEM_FRACTION
or its older name, and refuses both at once; jspec sets the older name, which every supported
jaxlib reads), and so is an allocator that takes no share (platform, cuda_async); the VMM
allocator keeps the share as its budget, so it gets jspec's too.
"""

from __future__ import annotations

import os

ALLOCATOR_MEM_FRACTION = "0.92"
SHARE_SETTINGS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jaxlib's names, newer first
UPDATE_MODE_ENV = "JSPEC_GRAMMAR_UPDATE_MODE"
ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
GRAMMAR_UPDATE_MODE = "SKIP_TEMP"  # what `choose_for_grammar` selects
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")  # JAX's CUDA backends, by package


def apply() -> None:
    """Set jspec's allocator (for the update mode) and share in the environment unless the user's
    settings already decide them."""
    if os.environ.get(UPDATE_MODE_ENV, "").strip() and not os.environ.get(ALLOCATOR):
        os.environ[ALLOCATOR] = "vmm"
    if (os.environ.get(ALLOCATOR, "default").lower() in ("default", "bfc", "vmm")
            and not any(k in os.environ for k in (*SHARE_SETTINGS, "XLA_PYTHON_CLIENT_PREALLOCATE"))):
        os.environ[SHARE_SETTINGS[1]] = ALLOCATOR_MEM_FRACTION


def share() -> float:
    """The share of a GPU the process's allocator may take: the user's (under either name) or jspec's."""
    return float(next((os.environ[k] for k in SHARE_SETTINGS if os.environ.get(k)), ALLOCATOR_MEM_FRACTION))


def _client_exists() -> bool:
    """Whether JAX has created its backends (then the allocator is fixed); True where this JAX
    cannot say, so that nothing is changed behind a client's back."""
    try:
        from jax._src import xla_bridge
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return True


def _cuda_machine() -> bool:
    """Whether JAX will run on CUDA: a CUDA plugin is installed and JAX_PLATFORMS, where set, allows it."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def choose_for_grammar(grammar_backend: str | None, tp_size: int | None) -> bool:
    """Select the VMM allocator and `GRAMMAR_UPDATE_MODE` for this process's constrained split
    steps when an engine with grammar_backend over tp_size devices (None: the default, one) is the
    process's first use of a CUDA device and the user decided none of it (see the module's
    docstring) -> whether it did."""
    if grammar_backend in (None, "none") or tp_size not in (None, 1):
        return False
    if UPDATE_MODE_ENV in os.environ or ALLOCATOR in os.environ \
            or "xla_gpu_command_buffer_update_mode" in os.environ.get("XLA_FLAGS", ""):
        return False
    if _client_exists() or not _cuda_machine():
        return False
    os.environ[UPDATE_MODE_ENV] = GRAMMAR_UPDATE_MODE
    os.environ[ALLOCATOR] = "vmm"
    return True
