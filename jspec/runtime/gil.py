"""The GIL switch interval of a process that serves an `Engine` to other threads.

The engine loop, the threads or event loop reading its streams, and (in `jspec serve`) uvicorn all
share one GIL; a thread that wants it waits for the holder to block or for the switch interval to
pass. At Python's default 5 ms a streamed token could wait that long at each hand-over while the
engine loop plans the next step, so `jspec serve` and the in-process serving benchmark run at a
shorter interval (`JSPEC_SWITCH_INTERVAL` seconds overrides it).
"""

from __future__ import annotations

import os

from jspec.errors import ConfigError

SWITCH_INTERVAL = 0.0005  # seconds


def switch_interval() -> float:
    """$JSPEC_SWITCH_INTERVAL seconds, else SWITCH_INTERVAL; a value that is not a positive number
    is a ConfigError naming the variable."""
    raw = os.environ.get("JSPEC_SWITCH_INTERVAL")
    if raw is None:
        return SWITCH_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"JSPEC_SWITCH_INTERVAL={raw!r}: must be a number of seconds > 0")
    return value
