"""Pallas kernels for jspec, one folder per operation.

Each folder holds `reference.py` (pure jnp, the oracle) beside its Pallas kernels. This package
imports nothing of `jspec`: kernels depend on jax alone.
"""
