"""jspec: speculative decoding in JAX with Pallas kernels."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import jspec.errors` stays light; `from jspec import Engine` pulls in the runtime.
    if name == "Engine":
        from jspec.api import Engine

        return Engine
    raise AttributeError(name)
