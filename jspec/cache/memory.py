"""How many KV pages an engine gets from the device's memory: SGLang's `mem_fraction_static`.

The static share of the device, `mem_fraction_static` x the allocator's limit, holds everything
that lives as long as the engine: what is already resident when the pools are sized (the weights
and the drafter, measured as the allocator's bytes in use, so another engine's leftovers count
too), the compiled steps' workspace (measured from the largest prompt and decode buckets), the
fixed-size per-slot buffers and the KV pages. The pages get what is left; the rest of the device
(1 - mem_fraction_static) absorbs what is not measured (allocator fragmentation, transfers).

The page count must not follow the few MiB by which the bytes in use drift between processes
(library workspaces, autotuning): a pool one page larger is a new shape for every compiled step,
which misses both XLA's persistent cache and jspec's compiled-step cache on a restart. So the
count is rounded down to a coarse step (`PAGE_STEPS` steps per power of two), and an earlier
start's count is kept while it still fits and is within one step of what fits now.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jspec import allocator_env
from jspec.cache import driver_memory
from jspec.errors import ConfigError

DEFAULT_MEM_FRACTION_STATIC = 0.88
GiB = float(1 << 30)
PAGE_STEPS = 64  # at most 1/64 of the pool given up for a page count that is stable across restarts


def page_step(num_pages: int) -> int:
    """The rounding step at num_pages: the power of two at or just under num_pages / PAGE_STEPS."""
    return 1 << max(0, num_pages.bit_length() - PAGE_STEPS.bit_length())


def round_pages(num_pages: int, min_pages: int = 1) -> int:
    """num_pages rounded down to a multiple of its step (never below min_pages, never above
    num_pages)."""
    step = page_step(num_pages)
    return min(num_pages, max(min_pages, num_pages // step * step))


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """bytes_limit: what XLA's allocator may hand out on the device; bytes_in_use: held now."""

    bytes_limit: int
    bytes_in_use: int


def device_memory(device=None) -> DeviceMemory | None:
    """The allocator's view of a device (default: the first), or None where the backend reports
    no limit (the CPU), in which case pools are sized from the engine's limits alone.

    A GPU allocator without statistics (XLA's VMM allocator, which takes nothing up front) is
    stood in for by the driver and the live arrays: the limit is the allocator share
    (`XLA_PYTHON_CLIENT_MEM_FRACTION`, see `jspec/allocator_env.py`) of the device's total, which by
    XLA's source is also the budget that allocator keeps. In use is what lies outside the allocator
    (`_outside_allocator`) plus the live arrays on the device. The driver's own count is not used as
    it is: that allocator keeps freed memory mapped for reuse (a shut-down engine's pool, the
    temporaries of programs that ran), and the driver counts it as held."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return DeviceMemory(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)))
    if device.platform != "gpu" or (held := driver_memory.free_total(device.local_hardware_id)) is None:
        return None
    free, total = held
    live = live_bytes(device)
    return DeviceMemory(int(allocator_env.share() * total), _outside_allocator(device, total - free, live) + live)


def note_outside_allocator() -> None:
    """Take a look at the first device before weights are placed on it (the loaders call this):
    under an allocator without statistics this sets what lies outside the allocator before any
    loader's temporaries are freed and kept mapped (`_outside_allocator`); otherwise it costs one
    statistics query."""
    device_memory()


# (platform, device ordinal) -> the least (driver's bytes in use - live arrays) seen in this process
_OUTSIDE: dict[tuple[str, int], int] = {}


def _outside_allocator(device, driver_in_use: int, live: int) -> int:
    """What the device holds outside the allocator's live buffers (the CUDA context, library
    handles, NCCL, other processes), as the least driver-minus-live-arrays seen so far: memory
    the allocator keeps mapped after a free only ever adds to the driver's count, so the earliest
    look (the loaders take one before placing weights: `note_outside_allocator`) is the closest,
    and later looks can only lower it. Memory that other processes take after that first look is
    not seen; the share outside mem_fraction_static absorbs it."""
    key = (device.platform, device.local_hardware_id)
    _OUTSIDE[key] = min(_OUTSIDE.get(key, driver_in_use), max(driver_in_use - live, 0))
    return _OUTSIDE[key]


def live_bytes(device) -> int:
    """Bytes of the process's live JAX arrays held on `device` (one shard of each array placed on
    it; a replicated array counts in full on each of its devices)."""
    total = 0
    for a in jax.live_arrays():
        sharding = a.sharding
        if device in sharding.device_set:
            total += math.prod(sharding.shard_shape(a.shape)) * getattr(a.dtype, "itemsize", 0)
    return total


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The bytes behind a pool size (`Engine.get_server_info()["memory"]` reports them).

    resident_bytes: in use when the pools were sized (weights, drafter, anything else on the
    device); workspace_bytes: the largest compiled step's temporary buffers; fixed_bytes: the
    per-slot buffers (GDN state, sampler counts, page table); page_bytes: one page of KV in every
    attention layer of the target and the drafter.
    """

    bytes_limit: int
    mem_fraction_static: float
    resident_bytes: int
    workspace_bytes: int
    fixed_bytes: int
    page_bytes: int
    num_pages: int


def plan_pages(memory: DeviceMemory, *, mem_fraction_static: float | None, page_bytes: int, fixed_bytes: int,
               workspace_bytes: int, min_pages: int, page_size: int, previous: int | None = None) -> MemoryPlan:
    """Pages (the sink page included) that fit the static share, rounded down (or `previous`, an
    earlier start's count, where it fits and gives up less than a step); ConfigError when fewer
    than min_pages fit, saying how much is missing and which setting changes it."""
    frac = DEFAULT_MEM_FRACTION_STATIC if mem_fraction_static is None else float(mem_fraction_static)
    if not 0.0 < frac <= 1.0:
        raise ConfigError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static!r}")
    static = int(frac * memory.bytes_limit)
    left = static - memory.bytes_in_use - workspace_bytes - fixed_bytes
    num_pages = max(left, 0) // max(page_bytes, 1)
    if num_pages < min_pages:
        need = memory.bytes_in_use + workspace_bytes + fixed_bytes + min_pages * page_bytes
        raise ConfigError(
            f"mem_fraction_static={frac} gives {static / GiB:.2f} GiB of the device's {memory.bytes_limit / GiB:.2f} "
            f"GiB for static memory, but {memory.bytes_in_use / GiB:.2f} GiB is already resident (weights, drafter, "
            f"other engines), the compiled steps need {workspace_bytes / GiB:.2f} GiB of workspace and the per-slot "
            f"buffers {fixed_bytes / GiB:.2f} GiB, which leaves room for {num_pages} KV pages of {page_size} tokens; "
            f"at least {min_pages} are needed ({need / GiB:.2f} GiB in all). Raise mem_fraction_static, lower "
            f"max_running_requests or context_length, or shut down other engines on this device")
    return MemoryPlan(bytes_limit=memory.bytes_limit, mem_fraction_static=frac, resident_bytes=memory.bytes_in_use,
                      workspace_bytes=workspace_bytes, fixed_bytes=fixed_bytes, page_bytes=page_bytes,
                      num_pages=keep_or_round(int(num_pages), min_pages, previous))


def keep_or_round(fits: int, min_pages: int, previous: int | None) -> int:
    """previous where it fits and gives up less than 1/PAGE_STEPS of what fits, else fits rounded."""
    if previous is not None and max(min_pages, fits * (1 - 1 / PAGE_STEPS)) <= previous <= fits:
        return previous
    return round_pages(fits, min_pages)
