"""Device work per decode step of profiled serving runs, side by side and by kernel: where a
constrained (split) step spends device time that the fused step does not, without the host's
timing in the figure.

Each run's steady window runs from one `--step` host mark (default `jspec.dispatch decode`) to
another, after the last prompt step (`--after`, default `jspec.dispatch extend`) and `--skip` marks
more, and ends `--tail` marks before the last one: whole step periods, so the GPU work that starts
inside it is that of as many steps as it holds, whatever the lag between host and device.
Per step: wall, GPU busy (kernel intervals merged), idle, kernels, and each kernel name's time
with its numeric suffixes dropped (XLA numbers fusions per compiled module, so the split parts'
and the fused step's names differ in the suffix only). The table lists the names whose time per
step differs most between the first run and each other.

    python3 bench/step_device_diff.py off=DIR/EAGLE3_v2_c32 open=DIR2/EAGLE3_v2_c32 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_profile import trace_events  # noqa: E402
from bench.trace_summary import merged_busy  # noqa: E402


def base_name(name: str) -> str:
    """A kernel's name without XLA's per-module numbering (`loop_select_fusion_39` -> `loop_select_fusion`)."""
    return re.sub(r"(_+\d+)+$", "", name)


def steady_window(events: list[dict], gpu_pids: set, *, step: str, after: str, skip: int, tail: int) \
        -> tuple[float, float, int]:
    """(start, end, steps) of the steady window: from the mark `skip` after the last `after` event
    to the mark `tail` before the last."""
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu_pids and "dur" in e]
    last_after = max((e["ts"] for e in host if e["name"].startswith(after)), default=float("-inf"))
    marks = sorted(e["ts"] for e in host if e["name"].startswith(step) and e["ts"] > last_after)
    marks = marks[skip:len(marks) - tail] if tail else marks[skip:]
    if len(marks) < 2:
        raise ValueError(f"fewer than two {step!r} marks after the last {after!r} (skip {skip}, tail {tail})")
    return marks[0], marks[-1], len(marks) - 1


def per_step(events: list[dict], gpu_pids: set, start: float, end: float, steps: int) -> dict:
    """The GPU work that starts in [start, end), per step."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e
               and start <= e["ts"] < end]
    by_name, calls = collections.Counter(), collections.Counter()
    for e in kernels:
        by_name[base_name(e["name"])] += e["dur"]
        calls[base_name(e["name"])] += 1
    busy = merged_busy([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    wall = (end - start) / steps
    return {"steps": steps, "wall_us": wall, "busy_us": busy / steps, "idle_us": wall - busy / steps,
            "kernels": len(kernels) / steps, "kernel_us": sum(by_name.values()) / steps,
            "by_name": {n: {"us": us / steps, "calls": calls[n] / steps} for n, us in by_name.items()}}


def differences(base: dict, other: dict, top: int) -> list[tuple[str, float, float, float, float]]:
    """(name, base us, other us, base calls, other calls) per step of the `top` names whose time differs most."""
    names = set(base["by_name"]) | set(other["by_name"])
    zero = {"us": 0.0, "calls": 0.0}
    rows = [(n, base["by_name"].get(n, zero)["us"], other["by_name"].get(n, zero)["us"],
             base["by_name"].get(n, zero)["calls"], other["by_name"].get(n, zero)["calls"]) for n in names]
    rows.sort(key=lambda r: -abs(r[2] - r[1]))
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=TRACE_DIR; the first is the base")
    ap.add_argument("--step", default="jspec.dispatch decode")
    ap.add_argument("--after", default="jspec.dispatch extend")
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--tail", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    results = {}
    for spec in args.runs:
        label, _, trace_dir = spec.partition("=")
        found = trace_events(trace_dir)
        if found is None:
            raise SystemExit(f"{label}: no trace under {trace_dir}")
        _, events, _, gpu_pids = found
        start, end, steps = steady_window(events, gpu_pids, step=args.step, after=args.after, skip=args.skip,
                                          tail=args.tail)
        results[label] = per_step(events, gpu_pids, start, end, steps)
    for label, r in results.items():
        print(f"{label}: {r['steps']} steps; per step wall {r['wall_us']:.0f} us, GPU busy {r['busy_us']:.0f}, "
              f"idle {r['idle_us']:.0f}, kernels {r['kernels']:.1f} ({r['kernel_us']:.0f} us summed)")
    labels = list(results)
    for label in labels[1:]:
        print(f"\nus per step, {labels[0]} -> {label} (calls per step), by |difference|:")
        for name, a, b, ca, cb in differences(results[labels[0]], results[label], args.top):
            print(f"  {b - a:+8.1f}  {a:8.1f} -> {b:8.1f}  ({ca:5.1f} -> {cb:5.1f})  {name[:90]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
