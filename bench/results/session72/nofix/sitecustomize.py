# On PYTHONPATH (with JSPEC_NO_DIALECT_FIX=1) for the A/B of session 72: pallas_kernels.mlir_dialects.install a no-op.
import os
if os.environ.get("JSPEC_NO_DIALECT_FIX") == "1":
    import pallas_kernels.mlir_dialects as _m
    _m.install = lambda: False
