"""The share of each GPU that JAX's allocator takes when it first touches the device, as importing
jspec sets it (`apply`, called by `jspec/__init__.py`). JAX's own
default is 75%, and `mem_fraction_static` is a share of what the allocator holds, so an engine
would use 0.88 x 0.75 = 66% of the device where SGLang's 0.88 means 88% of it. An engine owns
its GPUs: take 92% (what stays outside holds the CUDA context, NCCL's buffers and library
handles), unless the user chose.

`JSPEC_GRAMMAR_UPDATE_MODE` (`jspec/runtime/compile_options.py`) is honoured only by XLA's VMM
allocator, so setting it selects that allocator (`XLA_PYTHON_CLIENT_ALLOCATOR=vmm`) unless the user
chose one: the mode is then one setting, not two.

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
