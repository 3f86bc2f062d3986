"""The share of each GPU that JAX's allocator takes when it first touches the device, as importing
jspec sets it (`apply`, called by `jspec/__init__.py`). JAX's own
default is 75%, and `mem_fraction_static` is a share of what the allocator holds, so an engine
would use 0.88 x 0.75 = 66% of the device where SGLang's 0.88 means 88% of it. An engine owns
its GPUs: take 92% (what stays outside holds the CUDA context, NCCL's buffers and library
handles), unless the user chose.

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


def apply() -> None:
    """Set jspec's share in the environment unless the user's settings already decide it."""
    if (os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower() in ("default", "bfc", "vmm")
            and not any(k in os.environ for k in (*SHARE_SETTINGS, "XLA_PYTHON_CLIENT_PREALLOCATE"))):
        os.environ[SHARE_SETTINGS[1]] = ALLOCATOR_MEM_FRACTION


def share() -> float:
    """The share of a GPU the process's allocator may take: the user's (under either name) or jspec's."""
    return float(next((os.environ[k] for k in SHARE_SETTINGS if os.environ.get(k)), ALLOCATOR_MEM_FRACTION))
