"""jspec: speculative decoding in JAX with Pallas kernels."""

import os

__version__ = "0.1.0"

# The share of each GPU that JAX's allocator takes when it first touches the device. JAX's own
# default is 75%, and `mem_fraction_static` is a share of what the allocator holds, so an engine
# would use 0.88 x 0.75 = 66% of the device where SGLang's 0.88 means 88% of it. An engine owns
# its GPUs: take 92% (what stays outside holds the CUDA context, NCCL's buffers and library
# handles), unless the user chose (any XLA_PYTHON_CLIENT_* allocator setting is kept as given).
# Effective only when jspec is imported before JAX first allocates on a GPU. jaxlib reads the
# share from XLA_CLIENT_MEM_FRACTION or its older name (and refuses both at once), so a user's
# setting under either name is kept; jspec sets the older name, which every supported jaxlib reads.
ALLOCATOR_MEM_FRACTION = "0.92"
ALLOCATOR_SETTINGS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                      "XLA_PYTHON_CLIENT_ALLOCATOR")
if not any(k in os.environ for k in ALLOCATOR_SETTINGS):
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ALLOCATOR_MEM_FRACTION


def __getattr__(name):
    # Lazy: `import jspec.errors` stays light; `from jspec import Engine` pulls in the runtime.
    if name == "Engine":
        from jspec.api import Engine

        return Engine
    raise AttributeError(name)
