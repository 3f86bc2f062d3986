"""What an engine's start-up allocated, kept out of the garbage collector's full collections.

Building an engine leaves hundreds of thousands of long-lived Python objects (modules, traced and
compiled steps, the tokenizer). A full collection scans them all while holding the GIL, which stops
the engine loop for as long (a pause that grows with that heap), at a time chosen by how much
serving has allocated since. `gc.freeze` moves what exists now to a generation the collector never
scans, so later collections see only what serving allocates. Every `Engine` does this at the end
of its construction, after one full collection (so start-up's garbage is freed, not frozen), and
undoes it at shutdown, so that the engine's own objects can be collected once it is dropped.
`JSPEC_GC_FREEZE=0` turns it off.
"""

from __future__ import annotations

import gc
import os


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
