"""Watching XLA compilations from a test (the proof of "no recompilation after warm-up"), and the
compiler options of tests whose time is compiling."""

from __future__ import annotations

import contextlib

import jax
import numpy as np

# XLA CPU at -O0, for jitted test code that compiles far longer than it runs (the training tests).
FAST = {"xla_backend_optimization_level": 0}


@contextlib.contextmanager
def compilations():
    """Yields a list that collects every compilation event while the block runs. Before that it
    compiles something itself and checks the listener saw it: an empty list must mean nothing
    compiled, not a listener that hears nothing."""
    seen = []

    def listener(event, duration, **kw):
        if "compile" in event:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x * 3 + 1)(np.arange(5.0))
        assert seen, "compile listener saw nothing: a check on it would be vacuous"
        seen.clear()
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
