"""Pallas kernels for jspec, one folder per operation.

Each folder holds `reference.py` (pure jnp, the oracle) beside its Pallas kernels. This package
imports nothing of `jspec`: kernels depend on jax alone. Measured figures behind each folder's
choices live in its NOTES.md, not in the code.
"""
