"""Wall-clock spans of the engine loop's host phases, without a profiler: where a step's host time
goes (scheduling, packing, each part's launch, the forward's launch on the launcher thread,
reading the step in flight, the grammar walk) and how long the loop waits for the device.

A profiler slows the host several times over and so shows a host-bound loop more host-bound than
it is; these spans cost a `perf_counter` and a `thread_time` pair each. Each span also records the
CPU time its thread spent inside it: a span whose wall time exceeds its CPU time waited (for the
device, a lock, or the GIL, which the engine loop shares with the launcher thread and with the
event loop that reads the streams; `chunk` spans are that reader's work per streamed chunk). `record` wraps the loop's functions, runs a
`jspec` command in this process and writes the spans; `summary` prints, per benchmark run (each
`measure` call, e.g. each side of `--alternate-constraint`), the median of every phase over the
middle half of the decode steps, with the wall time per step and the loop's wait.

    python3 bench/host_phases.py record OUT.json -- bench serve --model-path ... --alternate-constraint 2
    python3 bench/host_phases.py summary OUT.json
    python3 bench/host_phases.py totals OUT.json    # every span summed per run, prompt steps included
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (module, attribute path, span name): what `record` wraps.
SPANS = (
    ("jspec.runtime.engine_core", "EngineCore.step", "step"),
    ("jspec.runtime.engine_core", "EngineCore._read_pending", "between"),
    ("jspec.runtime.engine_core", "EngineCore._process", "process"),
    ("jspec.runtime.scheduler", "Scheduler.schedule", "schedule"),
    ("jspec.runtime.model_runner", "pack", "pack"),
    ("jspec.runtime.model_runner", "ModelRunner.dispatch", "dispatch"),
    ("jspec.runtime.split_step", "SplitExecutable.begin", "begin"),
    ("jspec.runtime.split_step", "SplitExecutable.complete", "complete"),
    ("jspec.runtime.split_step", "_launch", "forward_launch"),
    ("jspec.runtime.grammar", "draft_inputs", "walk"),
    ("jspec.runtime.outputs", "StreamChunks.next", "chunk"),  # the stream reader's thread (an event loop)
    ("jspec.runtime.startup_runs", "warm_up", "warm_up"),  # start-up, before any run
    ("jspec.bench.serve", "measure", "run"),
    ("jspec.bench.sweep", "measure", "run"),  # the sweep holds its own name of it
)
PARTS = (("first", "first_call"), ("second", "second_call"), ("fused", "fused_call"))  # SplitExecutable's


def _span(events: list, name: str, fn):
    """fn, recording each call as (name, start, end, thread id, thread CPU seconds inside)."""
    def timed(*args, **kwargs):
        t, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            events.append((name, t, time.perf_counter(), threading.get_ident(), time.thread_time() - cpu))
    return timed


def install(events: list) -> None:
    """Wrap every function of SPANS, the fetch of a step's output, and each split executable's
    parts as it is built."""
    import importlib

    for module, path, name in SPANS:
        owner = importlib.import_module(module)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        setattr(owner, attr, _span(events, name, getattr(owner, attr)))
    from jspec.runtime import model_runner, split_step

    model_runner.ModelRunner.fetch = staticmethod(_span(events, "fetch", model_runner.ModelRunner.fetch))
    built = split_step.SplitExecutable.__init__

    def init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        for attr, name in PARTS:
            setattr(self, attr, _span(events, name, getattr(self, attr)))

    split_step.SplitExecutable.__init__ = init
    gc.callbacks.append(_gc_spans(events))


def _gc_spans(events: list):
    """A `gc.callbacks` hook recording each collection as a span named `gcN` (N: its generation):
    a full collection holds the GIL, so it stops the loop wherever it falls."""
    started: dict[int, float] = {}

    def hook(phase: str, info: dict) -> None:
        me = threading.get_ident()
        if phase == "start":
            started[me] = time.perf_counter()
        elif me in started:
            events.append((f"gc{info['generation']}", started.pop(me), time.perf_counter(), me))
    return hook


def record(out: str, argv: list[str]) -> int:
    from jspec.cli import main

    events: list = []
    install(events)
    try:
        return main(argv)
    finally:
        with open(out, "w") as f:
            json.dump(events, f)


def summarize(events: list) -> list[dict]:
    """One dict per run window (the whole trace when no `run` span): decode steps, wall per step
    (median, mean, p10, p90) and the loop thread's CPU time per step (median, where spans carry
    CPU times), and per phase its median duration, thread CPU time and start within the step, summed
    over the phase's calls in the step; the run's seconds, of which between the starts of its
    decode steps and their next steps; its garbage collections per generation (count, total and
    longest ms)."""
    out = []
    for run in _runs(events):
        inside = sorted((e for e in events if run[1] <= e[1] < run[2] and e[0] != "run"), key=lambda e: e[1])
        steps = [e for e in inside if e[0] == "step"]
        starts = [e[1] for e in inside]
        rows = []
        for s, nxt in zip(steps, steps[1:]):
            spans = [e for e in inside[bisect.bisect_left(starts, s[1]):bisect.bisect_left(starts, nxt[1])]
                     if e[0] != "step"]
            if not any(e[0] in ("first_call", "fused_call") for e in spans):
                continue  # not a step that launched a decode bucket's split or fused executable
            row = {"wall": nxt[1] - s[1]}
            if len(s) > 4:  # the step span's CPU time: the loop thread's, from the step's start to its end
                row["cpu"] = s[4]
            for name, start, end, _, *cpu in spans:
                row[name] = row.get(name, 0.0) + end - start
                row.setdefault(name + "@", start - s[1])
                if cpu:
                    row[name + "#"] = row.get(name + "#", 0.0) + cpu[0]
            rows.append(row)
        mid = rows[len(rows) // 4: 3 * len(rows) // 4]
        if not mid:
            continue
        wall = np.array([r["wall"] for r in mid]) * 1e3
        names = sorted({k for r in mid for k in r if k not in ("wall", "cpu") and not k.endswith(("@", "#"))},
                       key=lambda k: np.median([r[k + "@"] for r in mid if k in r]))
        gcs: dict[str, list[float]] = {}
        for e in inside:
            if e[0].startswith("gc"):
                g = gcs.setdefault(e[0], [0, 0.0, 0.0])
                g[0], g[1], g[2] = g[0] + 1, g[1] + (e[2] - e[1]) * 1e3, max(g[2], (e[2] - e[1]) * 1e3)
        out.append({
            "run_s": float(run[2] - run[1]) if np.isfinite(run[1]) else None,
            "decode_s": float(sum(r["wall"] for r in rows)), "gc": gcs,
            "decode_steps": len(rows), "summarised": len(mid),
            "wall_ms": {"median": float(np.median(wall)), "mean": float(wall.mean()),
                        "p10": float(np.percentile(wall, 10)), "p90": float(np.percentile(wall, 90))},
            "loop_cpu_ms": _median_ms([r["cpu"] for r in mid if "cpu" in r]),
            "phases_ms": {k: {"median": float(np.median([r[k] for r in mid if k in r]) * 1e3),
                              "cpu": _median_ms([r[k + "#"] for r in mid if k + "#" in r]),
                              "at": float(np.median([r[k + "@"] for r in mid if k in r]) * 1e3),
                              "in_steps": sum(k in r for r in mid)} for k in names},
        })
    return out


def totals(events: list) -> list[dict]:
    """One dict per run window: every span's calls, wall ms and CPU ms summed over the whole run
    (prompt steps and streamed chunks included, which `summarize` leaves out), and the run's
    seconds; to compare two runs of one workload that differ in what a request asks for."""
    out = []
    for run in _runs(events):
        spans: dict[str, list] = {}
        for name, start, end, _, *cpu in events:
            if name != "run" and run[1] <= start < run[2]:
                t = spans.setdefault(name, [0, 0.0, 0.0])
                t[0], t[1] = t[0] + 1, t[1] + (end - start) * 1e3
                t[2] += cpu[0] * 1e3 if cpu else 0.0
        out.append({"run_s": float(run[2] - run[1]) if np.isfinite(run[1]) else None,
                    "spans": {k: {"calls": v[0], "wall_ms": v[1], "cpu_ms": v[2]} for k, v in sorted(spans.items())}})
    return out


def _runs(events: list) -> list:
    """The `run` spans in time order (the whole trace as one window when there is none)."""
    return sorted((e for e in events if e[0] == "run"), key=lambda e: e[1]) or [("run", -np.inf, np.inf, 0)]


def _median_ms(seconds: list) -> float | None:
    return float(np.median(seconds) * 1e3) if seconds else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run a jspec command (after --) with the spans installed")
    r.add_argument("out")
    r.add_argument("command", nargs=argparse.REMAINDER)
    s = sub.add_parser("summary", help="print what record wrote")
    s.add_argument("path")
    t = sub.add_parser("totals", help="print each span's calls, wall and CPU time summed per run")
    t.add_argument("path")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return record(args.out, command)
    if args.cmd == "totals":
        with open(args.path) as f:
            for i, run in enumerate(totals(json.load(f))):
                print(f"run {i}: {run['run_s'] or float('nan'):.3f} s")
                for name, v in run["spans"].items():
                    print(f"  {name:15s} {v['calls']:6d} calls  wall {v['wall_ms']:9.1f} ms  cpu {v['cpu_ms']:8.1f} ms")
        return 0
    with open(args.path) as f:
        for i, run in enumerate(summarize(json.load(f))):
            w = run["wall_ms"]
            print(f"run {i}: {run['decode_steps']} decode steps; wall per step median {w['median']:.3f} ms, mean "
                  f"{w['mean']:.3f} (p10 {w['p10']:.3f}, p90 {w['p90']:.3f}) over the middle {run['summarised']}")
            if run["loop_cpu_ms"] is not None:
                print(f"  the loop thread's CPU time per step: median {run['loop_cpu_ms']:.3f} ms")
            if run["run_s"] is not None:
                print(f"  run {run['run_s']:.3f} s, of which in the steps above {run['decode_s']:.3f} s")
            for gen, (n, total, longest) in sorted(run["gc"].items()):
                print(f"  {gen}: {n} collections, {total:.1f} ms in all, longest {longest:.1f} ms")
            for name, p in run["phases_ms"].items():
                cpu = "" if p["cpu"] is None else f"  cpu {p['cpu']:7.3f} ms"
                print(f"  {name:15s} at {p['at']:7.3f} ms  median {p['median']:7.3f} ms{cpu}  (in {p['in_steps']} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
