"""The thread pool that compiles an engine's buckets at start-up, beside the main thread's tracing.

A cold start's critical path is the main thread: it traces and lowers one bucket after another
(holding the GIL), and each bucket compiles on this pool as soon as it is lowered. XLA's compiles
release the GIL but not the cores, so with a worker per core they take CPU time from the main
thread, and the serial lowering stretches. Workers can run at a lower scheduling priority
(`JSPEC_COMPILE_NICE`, a nice increment, Linux only): the main thread, whenever it
is runnable, is scheduled before them, and the compiles use what is left. 0 (the default) leaves
priorities alone; bench/README.md ("Start-up") records whether it shortens a GPU cold start.

Threads that a worker starts inherit its priority; XLA's own thread pools, created earlier by the
main thread, do not.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from jspec.errors import ConfigError


def compile_nice() -> int:
    """$JSPEC_COMPILE_NICE as a nice increment in 0..19 (default 0); anything else is a ConfigError
    naming the variable."""
    raw = os.environ.get("JSPEC_COMPILE_NICE", "0")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ConfigError(f"JSPEC_COMPILE_NICE={raw!r}: must be an integer nice increment in 0..19")
    return value


def _lower_own_priority(increment: int) -> None:
    """Raise the calling thread's nice value by `increment` (a thread's own id is a PRIO_PROCESS
    target on Linux). Lowering one's own priority needs no privilege; elsewhere it is skipped."""
    if increment and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


def compile_pool(max_workers: int, nice: int | None = None) -> ThreadPoolExecutor:
    """A pool of `max_workers` threads, each at `nice` (default: `compile_nice()`) above the
    priority it started with."""
    nice = compile_nice() if nice is None else nice
    return ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix="jspec-compile",
                              initializer=_lower_own_priority, initargs=(nice,))
