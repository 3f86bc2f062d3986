"""Where MLIR's Python bindings find the Python module of JAX's Triton dialect (`tt`).

Whenever the bindings hand an operation to Python, they first import the Python module of its
dialect, trying each search prefix in turn (`jaxlib.mlir.dialects.<namespace>`, ...). A module
found is remembered; one not found is searched for again at the next operation. The `tt` dialect's
module is `jaxlib.triton.dialect`, under none of those prefixes, so every Triton lowering of a
Pallas kernel pays three failed imports for each operation it builds, on the main thread that
traces and lowers an engine's steps one after another. `install()` appends a prefix of this
module's own under which `tt` names that module: the next lookup finds it and the bindings
remember it. The bindings then wrap `tt` operations in the dialect's own Python classes (the
module registers them) instead of the generic one; the lowered IR is the same.
"""

from __future__ import annotations

import sys

PREFIX = __name__  # `pallas_kernels.mlir_dialects.tt` is the Triton dialect's Python module


def install() -> bool:
    """Point MLIR's dialect lookup at JAX's Triton dialect module (once per process; a no-op
    where this jax has none) -> whether the lookup now finds it."""
    try:
        from jax._src.lib import triton
        from jaxlib.mlir._mlir_libs import _mlir
    except ImportError:
        return False
    dialect = getattr(triton, "dialect", None)
    if dialect is None:
        return False
    sys.modules.setdefault(f"{PREFIX}.tt", dialect)
    if PREFIX not in _mlir.globals.dialect_search_modules:
        _mlir.globals.append_dialect_search_prefix(PREFIX)
    return True
