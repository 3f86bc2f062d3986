"""bench/host_phases.py: the per-run summary of host-phase spans, and its wrapping of the loop."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from bench.host_phases import _gc_spans, summarize, totals

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _steps(t0: float, n: int, period: float, walk: float, run: bool = True) -> list:
    """n split decode steps from t0, one every `period` s, each with a draft launch and a walk."""
    ev = [("run", t0 - 0.5, t0 + n * period + 0.5, 1)] if run else []
    for i in range(n):
        t = t0 + i * period
        ev += [("step", t, t + period * 0.9, 1), ("first_call", t + 0.001, t + 0.002, 1),
               ("walk", t + 0.003, t + 0.003 + walk, 1)]
    return ev


def test_summary_gives_each_run_its_own_step_times_and_phases():
    events = _steps(100.0, 40, 0.008, 0.002) + _steps(200.0, 40, 0.010, 0.004)
    events.append(("step", 150.0, 150.1, 1))  # between the runs: in no run window
    first, second = summarize(events)
    assert first["decode_steps"] == 39 and second["decode_steps"] == 39  # the last step has no successor
    assert first["wall_ms"]["median"] == pytest.approx(8.0) and second["wall_ms"]["median"] == pytest.approx(10.0)
    assert first["phases_ms"]["walk"]["median"] == pytest.approx(2.0)
    assert second["phases_ms"]["walk"]["median"] == pytest.approx(4.0)
    assert second["phases_ms"]["walk"]["at"] == pytest.approx(3.0)
    assert list(first["phases_ms"]) == ["first_call", "walk"]  # in the order they start within a step
    # A trace without run spans is one window; a step that launched no decode executable is left out
    # (here it only ends the last decode step).
    (whole,) = summarize(_steps(0.0, 20, 0.008, 0.002, run=False) + [("step", 0.16, 0.2, 1)])
    assert whole["decode_steps"] == 20


def test_record_wraps_the_loop_of_this_checkout(tmp_path):
    """Every wrapped function exists (a renamed one fails here, not on a GPU machine)."""
    out = tmp_path / "spans.json"
    cmd = [sys.executable, "bench/host_phases.py", "record", str(out), "--", "bench", "serve", "--help"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    # Nothing ran but the argument parser: no loop spans (garbage collections may have run).
    assert [e for e in json.loads(out.read_text()) if not e[0].startswith("gc")] == []


def test_garbage_collections_are_spans_counted_per_run():
    events: list = []
    hook = _gc_spans(events)
    gc.callbacks.append(hook)
    try:
        gc.collect(2)
    finally:
        gc.callbacks.remove(hook)
    assert [e[0] for e in events] == ["gc2"] and events[0][1] <= events[0][2]
    run = _steps(100.0, 40, 0.008, 0.002)
    run += [("gc2", 100.1, 100.22, 1), ("gc0", 100.2, 100.201, 1), ("gc0", 100.3, 100.303, 1)]
    (summary,) = summarize(run + [("gc2", 99.0, 99.5, 1)])  # before the run: not its own
    assert summary["gc"]["gc2"] == pytest.approx([1, 120.0, 120.0])
    assert summary["gc"]["gc0"] == pytest.approx([2, 4.0, 3.0])
    assert summary["run_s"] == pytest.approx(40 * 0.008 + 1.0)
    assert summary["decode_s"] == pytest.approx(39 * 0.008)


def test_spans_with_cpu_times_report_the_time_their_thread_ran():
    """A span's fifth field is its thread's CPU seconds inside it: summed per step and phase (a
    phase called several times a step, as the stream reader's chunks, adds up), and the step span's
    is the loop thread's CPU time per step."""
    events = [("run", 99.0, 101.0, 1)]
    for i in range(20):
        t = 100.0 + i * 0.01
        events += [("step", t, t + 0.009, 1, 0.006), ("fused_call", t + 0.001, t + 0.003, 1, 0.0005),
                   ("chunk", t + 0.004, t + 0.0045, 2, 0.0004), ("chunk", t + 0.005, t + 0.0055, 2, 0.0003)]
    (summary,) = summarize(events)
    assert summary["loop_cpu_ms"] == pytest.approx(6.0)
    assert summary["phases_ms"]["fused_call"]["median"] == pytest.approx(2.0)
    assert summary["phases_ms"]["fused_call"]["cpu"] == pytest.approx(0.5)
    assert summary["phases_ms"]["chunk"]["median"] == pytest.approx(1.0)
    assert summary["phases_ms"]["chunk"]["cpu"] == pytest.approx(0.7)
    # Spans recorded without CPU times (older records) leave it None.
    (old,) = summarize(_steps(100.0, 20, 0.008, 0.002))
    assert old["loop_cpu_ms"] is None and old["phases_ms"]["walk"]["cpu"] is None


def test_record_writes_cpu_times_of_the_wrapped_calls(tmp_path):
    from bench.host_phases import _span

    events: list = []
    busy = _span(events, "busy", lambda: sum(range(200_000)))
    busy()
    ((name, start, end, _, cpu),) = events
    assert name == "busy" and 0 < cpu <= (end - start) * 1.05 + 1e-3


def test_totals_sum_every_span_of_each_run_prompt_steps_included():
    """`totals` adds up every span in a run window (calls, wall ms, CPU ms, a span without a CPU
    time counting none), where `summarize` keeps only decode steps."""
    events = [("run", 10.0, 11.0, 1), ("run", 20.0, 22.0, 1),
              ("process", 10.1, 10.13, 1, 0.01), ("process", 10.5, 10.51, 1, 0.005), ("gc0", 10.6, 10.602, 1),
              ("chunk", 20.1, 20.104, 2, 0.003), ("process", 15.0, 15.5, 1, 0.1)]  # the last: in no run
    first, second = totals(events)
    assert first["run_s"] == pytest.approx(1.0) and second["run_s"] == pytest.approx(2.0)
    assert first["spans"]["process"] == pytest.approx({"calls": 2, "wall_ms": 40.0, "cpu_ms": 15.0})
    assert first["spans"]["gc0"] == pytest.approx({"calls": 1, "wall_ms": 2.0, "cpu_ms": 0.0})
    assert list(second["spans"]) == ["chunk"]
