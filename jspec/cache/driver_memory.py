"""A CUDA device's free and total memory from the driver (`cuMemGetInfo`), for allocators that
report no statistics.

XLA's VMM allocator (`XLA_PYTHON_CLIENT_ALLOCATOR=vmm`, which `JSPEC_GRAMMAR_UPDATE_MODE` selects;
`--xla_gpu_command_buffer_update_mode=SKIP_TEMP` in XLA_FLAGS selects it too) answers
`memory_stats()` with None and takes no share of the device up front, so the pool sizing
(`jspec.cache.memory`) asks the driver instead (and counts that allocator's share by the live
arrays: it keeps freed memory mapped, which the driver counts as held).
The query runs in the device's primary context, the one XLA itself uses, through ctypes: no CUDA
library beyond the driver that JAX has already loaded.
"""

from __future__ import annotations

import ctypes


def free_total(ordinal: int) -> tuple[int, int] | None:
    """(free, total) bytes of CUDA device `ordinal`, or None where there is no CUDA driver or a
    call fails (a CPU host, a device the driver cannot open)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, context = ctypes.c_int(), ctypes.c_void_p()
    if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal)
            or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)):
        return None
    try:
        if cuda.cuCtxPushCurrent_v2(context):
            return None
        try:
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
                return None
            return free.value, total.value
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)
