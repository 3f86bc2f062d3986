"""A few steps of a profiled run as a timeline, to read the order of host and device work: each
GPU stream's kernels merged into busy blocks (kernels less than `--merge-us` apart; first and last
kernel named, with the count), interleaved with the host events that tell a step's story (jspec's
annotations, the jitted calls and their launches, host-device copies, command-buffer updates), by
start time relative to the window. The window runs from the start of the `--first`-th host event
named `--step` (default `jspec.dispatch decode`) to the start of the one `--steps` later.

Where `bench/trace_summary.py` sums the idle between kernels by the pair around it, this shows
which host work each gap waits on and on which thread (e.g. the forward part's launch on the
launcher thread against the grammar walk on the engine thread).

    python3 bench/trace_timeline.py TRACE_DIR --first 20 --steps 3 > timeline.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_profile import trace_events  # noqa: E402

HOST_MARKS = ("jspec.", "PjitFunction", "np.asarray", "command_buffer::update", "cuGraphLaunch", "ExecuteHelper",
              "MemcpyD2H", "MemcpyH2D")


def busy_blocks(kernels: list[dict], merge_us: float) -> list[dict]:
    """One stream's kernels, merged while each starts less than merge_us after the block's end."""
    blocks: list[dict] = []
    for e in sorted(kernels, key=lambda e: e["ts"]):
        end = e["ts"] + e["dur"]
        if blocks and e["ts"] - blocks[-1]["end"] < merge_us:
            b = blocks[-1]
            b["end"], b["count"], b["last"] = max(b["end"], end), b["count"] + 1, e["name"]
        else:
            blocks.append({"start": e["ts"], "end": end, "count": 1, "first": e["name"], "last": e["name"]})
    return blocks


def timeline(events: list[dict], gpu_pids: set, thread_names: dict, *, step: str, first: int, steps: int,
             merge_us: float = 10.0) -> tuple[float, list[dict]]:
    """(window length in us, rows sorted by start): GPU busy blocks and the marked host events
    that start inside the window; each row has start (relative), dur, where, count, first, last."""
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    marks = sorted((e["ts"] for e in timed if e.get("pid") not in gpu_pids and e["name"].startswith(step)))
    if len(marks) <= first:
        raise SystemExit(f"only {len(marks)} host events named {step!r}; --first {first} is past them")
    t0, t1 = marks[first], marks[min(first + steps, len(marks) - 1)]
    inside = [e for e in timed if t0 <= e["ts"] <= t1]
    streams = collections.defaultdict(list)
    for e in inside:
        if e.get("pid") in gpu_pids:
            streams[(e["pid"], e.get("tid"))].append(e)
    rows = [dict(b, where=f"GPU stream {tid}") for (_, tid), evs in streams.items() for b in busy_blocks(evs, merge_us)]
    for e in inside:
        if e.get("pid") not in gpu_pids and any(m in e["name"] for m in HOST_MARKS):
            thread = thread_names.get((e["pid"], e.get("tid"))) or str(e.get("tid"))
            rows.append({"start": e["ts"], "end": e["ts"] + e["dur"], "count": 1, "first": e["name"],
                         "last": e["name"], "where": f"host {thread}"})
    rows.sort(key=lambda r: (r["start"], r["where"]))
    for r in rows:
        r["start"], r["dur"] = r["start"] - t0, r.pop("end") - r["start"]
    return t1 - t0, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--step", default="jspec.dispatch decode", help="host event that starts a step")
    ap.add_argument("--first", type=int, default=20, help="which step the window starts at (0-based)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--merge-us", type=float, default=10.0)
    args = ap.parse_args()
    found = trace_events(args.trace_dir)
    if found is None:
        raise SystemExit(f"no trace under {args.trace_dir}")
    _, events, _, gpu_pids = found
    thread_names = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    span, rows = timeline(events, gpu_pids, thread_names, step=args.step, first=args.first, steps=args.steps,
                          merge_us=args.merge_us)
    print(f"window {span:.0f} us: steps {args.first}..{args.first + args.steps}; start and duration in us")
    for r in rows:
        tail = f" .. {r['last'][:40]}" if r["count"] > 1 else ""
        print(f"{r['start']:9.0f} {r['dur']:8.0f}  {r['where'][:28]:28s} x{r['count']:<4d} {r['first'][:50]}{tail}")


if __name__ == "__main__":
    main()
