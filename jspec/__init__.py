"""jspec: speculative decoding in JAX with Pallas kernels."""

from jspec import allocator_env

__version__ = "0.1.0"

allocator_env.apply()  # before JAX first touches a GPU, so on import of jspec


def __getattr__(name):
    # Lazy: `import jspec.errors` stays light; `from jspec import Engine` pulls in the runtime.
    if name == "Engine":
        from jspec.api import Engine

        return Engine
    raise AttributeError(name)
