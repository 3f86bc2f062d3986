"""jspec: speculative decoding in JAX with Pallas kernels."""

__version__ = "0.1.0"
