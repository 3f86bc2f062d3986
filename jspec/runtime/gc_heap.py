"""What an engine's start-up allocated, kept out of the garbage collector's full collections.

Building an engine leaves hundreds of thousands of long-lived Python objects (modules, traced and
compiled steps, the tokenizer). A full collection scans them all while holding the GIL, which stops
the engine loop for as long (a pause that grows with that heap), at a time chosen by how much
serving has allocated since. `gc.freeze` moves what exists now to a generation the collector never
scans, so later collections see only what serving allocates. Every `Engine` does this at the end
of its construction, after one full collection (so start-up's garbage is freed, not frozen), and
undoes it at shutdown, so that the engine's own objects can be collected once it is dropped.
`JSPEC_GC_FREEZE=0` turns it off.

Serving then builds logprob rows in bulk: a 1024-token prompt's input logprobs with 5 top each are
about 6,000 tracked lists and tuples that live as long as their request. Every 700 such allocations
start a young collection, every tenth of those an older one, and the full collections that follow
scan every row still alive (each prompt's), so the collector's work grows with the live rows times
the rate they are built. `paused()` holds the collector off while a batch of rows is built; the
next allocation after it runs one young collection over them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading


def enabled() -> bool:
    """Whether engines freeze the heap they start with ($JSPEC_GC_FREEZE, default on)."""
    return os.environ.get("JSPEC_GC_FREEZE", "1") != "0"


def freeze_startup() -> bool:
    """Collect start-up's garbage, then freeze every object alive now -> whether it did."""
    if not enabled():
        return False
    gc.collect()
    gc.freeze()
    return True


def unfreeze() -> None:
    """Hand the frozen objects back to the collector (an engine shutting down: its objects become
    garbage once dropped; another engine alive in this process stays correct, only unfrozen)."""
    gc.unfreeze()


class _Pause:
    """Who holds the collector off now. Kept in an object, not in module-level scalars: those feed
    the compiled-step cache's code digest (`executable_cache.code_digest`), and a flag that flips
    while serving would change every key computed after it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.holders = 0  # threads inside paused() now
        self.resume = False  # whether the collector was on when the first of them entered


_pause = _Pause()


@contextlib.contextmanager
def paused():
    """No automatic collection inside the block (any thread's). Blocks may nest and overlap across
    threads: the collector comes back when the last one leaves, and only if it was on when the
    first one entered (a caller that turned it off keeps it off)."""
    with _pause.lock:
        if _pause.holders == 0:
            _pause.resume = gc.isenabled()
            gc.disable()
        _pause.holders += 1
    try:
        yield
    finally:
        with _pause.lock:
            _pause.holders -= 1
            if _pause.holders == 0 and _pause.resume:
                gc.enable()
