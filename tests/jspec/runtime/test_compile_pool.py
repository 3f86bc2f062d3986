"""The start-up compile pool (`compile_pool`): workers at the requested nice increment above the
thread that made them, the main thread untouched, and `JSPEC_COMPILE_NICE` read with a typed error."""

from __future__ import annotations

import os
import threading

import pytest

from jspec.errors import ConfigError
from jspec.runtime.compile_pool import compile_nice, compile_pool

linux_only = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities are Linux-only")


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
@pytest.mark.parametrize("nice", [0, 7])
def test_workers_run_at_the_increment_and_the_main_thread_keeps_its_priority(nice):
    main = _own_nice()
    with compile_pool(3, nice=nice) as pool:
        seen = set(pool.map(lambda _: _own_nice(), range(12)))
    assert seen == {min(19, main + nice)}
    assert _own_nice() == main


def test_compile_nice_reads_the_variable_and_names_it_when_wrong(monkeypatch):
    monkeypatch.delenv("JSPEC_COMPILE_NICE", raising=False)
    assert compile_nice() == 0
    monkeypatch.setenv("JSPEC_COMPILE_NICE", "10")
    assert compile_nice() == 10
    for bad in ("x", "-1", "20", "2.5"):
        monkeypatch.setenv("JSPEC_COMPILE_NICE", bad)
        with pytest.raises(ConfigError, match="JSPEC_COMPILE_NICE"):
            compile_nice()
