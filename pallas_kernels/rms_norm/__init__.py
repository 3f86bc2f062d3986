"""RMSNorm kernels (Pallas): `add_rms_norm`, the residual add and the norm after it in one kernel
(`kernel.py`); `reference.py` is the oracle."""

from pallas_kernels.rms_norm.kernel import add_rms_norm

__all__ = ["add_rms_norm"]
