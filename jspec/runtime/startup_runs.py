"""Steps an engine runs at start-up on padding rows: each compiled step once (warm-up), and the
decode steps timed for the adaptive speculation policy.

The first run of a compiled step on a GPU loads its kernels and builds its command buffers (CUDA
graphs), work that would otherwise fall on the first request that needs that step; SGLang's
CUDA-graph capture runs every graph for the same reason. Padding rows read every weight at the
bucket's shape and write only the padding slot and page, so the state the engine serves from is
as if nothing ran.
"""

from __future__ import annotations

import os
import time

from jspec.errors import ConfigError
from jspec.models.batch import ForwardMode


def warms_up(platform: str) -> bool:
    """Whether an engine runs each compiled step once at start-up: $JSPEC_WARM_UP ("1" / "0"),
    else on GPUs only (a CPU's first run costs nothing of the kind, and tests build many engines)."""
    raw = os.environ.get("JSPEC_WARM_UP")
    if raw is None:
        return platform == "gpu"
    if raw not in ("0", "1"):
        raise ConfigError(f"JSPEC_WARM_UP={raw!r}: must be 0 or 1")
    return raw == "1"


def warm_up(runner) -> int:
    """Run every bucket's compiled step once (a split step: each of its parts, then its fused
    twin), one after another -> how many buckets ran."""
    for bucket in runner.buckets:
        runner.run_padding(bucket, every_part=True).block_until_ready()
    return len(runner.buckets)


def time_decode_steps(runner, repeats: int = 3) -> dict[int, dict[int, float]]:
    """Seconds per decode step of each batch bucket and variant, {B: {drafts per request: s}}
    (0: the plain step), the fastest of `repeats` runs on padding rows (every weight read and every
    matmul at the bucket's shape; attention over an empty context). Waits for the device."""
    full = runner.drafting.max_accept - 1
    times: dict[int, dict[int, float]] = {}
    for bucket in runner.buckets:
        if bucket.mode is not ForwardMode.DECODE or bucket.sort:
            continue
        samples = []
        for i in range(repeats + 1):  # the first run may pay for loading the executable
            t0 = time.perf_counter()
            runner.run_padding(bucket).block_until_ready()
            if i:
                samples.append(time.perf_counter() - t0)
        k = 0 if not bucket.speculate else bucket.draft_steps or full
        times.setdefault(bucket.batch_size, {})[k] = min(samples)
    return times
