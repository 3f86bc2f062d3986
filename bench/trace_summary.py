"""Where a profiled step's GPU time goes, per device: busy time (kernel intervals merged), the span
from first to last kernel, idle = span - busy, kernel count, collective kernels, and the top kernels;
and the host's busiest events; and where the idle time falls: the gaps between consecutive kernels,
summed by the pair of kernels around each gap (a graph boundary, a host round trip or a launch
shows as the same pair every step), and the host events that overlap the long gaps (what the host
was doing while the GPU waited).

Reads the perfetto traces that `jspec bench step --profile DIR` writes (one folder per point) and
prints one block per trace; `--json` also writes the figures.

    python3 bench/trace_summary.py DIR [DIR ...] --steps 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_profile import trace_events  # noqa: E402

COLLECTIVE_MARKS = ("nccl", "allreduce", "all_reduce", "all-reduce", "collective")


def merged_busy(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (kernels on several streams overlap)."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def summarise(trace_dir: str, steps: int) -> dict:
    found = trace_events(trace_dir)
    if found is None:
        return {"trace_dir": trace_dir, "error": "no perfetto trace (profile with create_perfetto_trace=True)"}
    _, events, pid_name, gpu_pids = found
    per_dev: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            per_dev[e["pid"]].append(e)
    devices = []
    for pid, evs in sorted(per_dev.items()):
        iv = [(e["ts"], e["ts"] + e["dur"]) for e in evs]
        busy = merged_busy(iv)
        span = max(b for _, b in iv) - min(a for a, _ in iv)
        by_name = collections.Counter()
        count = collections.Counter()
        for e in evs:
            by_name[e["name"]] += e["dur"]
            count[e["name"]] += 1
        coll = {n: us for n, us in by_name.items() if any(m in n.lower() for m in COLLECTIVE_MARKS)}
        devices.append({
            "device": pid_name.get(pid, str(pid)), "kernels_per_step": len(evs) / steps,
            "busy_us_per_step": busy / steps, "span_us_per_step": span / steps,
            "idle_us_per_step": (span - busy) / steps,
            "collective_us_per_step": sum(coll.values()) / steps,
            "collective_calls_per_step": sum(count[n] for n in coll) / steps,
            "collective_kernels": sorted(coll, key=coll.get, reverse=True)[:5],
            "top": [{"name": n[:100], "us_per_step": us / steps, "calls_per_step": count[n] / steps}
                    for n, us in by_name.most_common(15)],
            "gaps": idle_gaps(evs, steps)})
    if not devices:
        return {"trace_dir": trace_dir, "error": f"no GPU kernels; processes: {sorted(set(pid_name.values()))[:20]}"}
    return {"trace_dir": trace_dir, "steps": steps, "devices": devices, "host": host_summary(events, gpu_pids, steps),
            "host_in_gaps": idle_host_work(events, gpu_pids, steps)}


def kernel_gaps(evs: list[dict], min_us: float) -> list[tuple[float, float, str, str]]:
    """The gaps of min_us or more between one device's kernels, in time order: (start, end, kernel
    before, kernel after); a kernel running beside a longer one (another stream) opens no gap."""
    evs = sorted(evs, key=lambda e: e["ts"])
    gaps = []
    end, before = evs[0]["ts"] + evs[0]["dur"], evs[0]["name"]
    for e in evs[1:]:
        if e["ts"] - end >= min_us:
            gaps.append((end, e["ts"], before, e["name"]))
        if e["ts"] + e["dur"] >= end:
            end, before = e["ts"] + e["dur"], e["name"]
    return gaps


def idle_gaps(evs: list[dict], steps: int, top: int = 12, min_us: float = 2.0) -> list[dict]:
    """Idle time between consecutive kernels of one device (gaps of min_us or more), summed per
    (kernel before, kernel after) pair, the largest first."""
    total, count = collections.Counter(), collections.Counter()
    for g0, g1, before, after in kernel_gaps(evs, min_us):
        pair = (before[:60], after[:60])
        total[pair] += g1 - g0
        count[pair] += 1
    return [{"before": b, "after": a, "us_per_step": us / steps, "gaps_per_step": count[(b, a)] / steps}
            for (b, a), us in total.most_common(top)]


def idle_host_work(events, gpu_pids, steps: int, top: int = 15, min_gap_us: float = 20.0) -> list[dict]:
    """What the host was doing while the GPU idled: for every gap of min_gap_us or more between the
    kernels of the first GPU, the host events (any thread) that overlap it, their overlap summed
    per event name (nested events count for each of their names: a parent covers its children)."""
    first = [e for e in events if e.get("ph") == "X" and e.get("pid") == min(gpu_pids) and "dur" in e]
    gaps = kernel_gaps(first, min_gap_us) if first else []
    if not gaps:
        return []
    gap_starts, gap_ends = [g[0] for g in gaps], [g[1] for g in gaps]
    overlap = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("pid") in gpu_pids or "dur" not in e:
            continue
        h0, h1 = e["ts"], e["ts"] + e["dur"]
        # the gaps this event overlaps: those ending after it starts and starting before it ends
        for i in range(bisect.bisect_right(gap_ends, h0), bisect.bisect_left(gap_starts, h1)):
            overlap[e["name"]] += min(h1, gap_ends[i]) - max(h0, gap_starts[i])
    idle = sum(g1 - g0 for g0, g1 in zip(gap_starts, gap_ends))
    return [{"name": n[:100], "us_per_step": us / steps, "share_of_gaps": us / idle}
            for n, us in overlap.most_common(top)]


def host_summary(events, gpu_pids, steps: int, top: int = 25) -> list[dict]:
    """The host's event names (runtime work such as thunk execution, launches, rendezvous) by self
    time per step (an event's duration less its children's on the same thread): where the host
    spends a step that the GPU idles through."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu_pids and "dur" in e:
            by_thread[(e["pid"], e.get("tid"))].append(e)
    self_us, total_us, count = collections.Counter(), collections.Counter(), collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, children's time]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, kids = stack.pop()
                self_us[name] -= kids
            if stack:
                stack[-1][2] += e["dur"]
            self_us[e["name"]] += e["dur"]
            total_us[e["name"]] += e["dur"]
            count[e["name"]] += 1
            stack.append([e["ts"] + e["dur"], e["name"], 0.0])
        for _, name, kids in stack:
            self_us[name] -= kids
    return [{"name": n[:100], "self_us_per_step": us / steps, "us_per_step": total_us[n] / steps,
             "calls_per_step": count[n] / steps} for n, us in self_us.most_common(top)]


def show(s: dict) -> None:
    print(f"== {s['trace_dir']}")
    if "error" in s:
        print("  ", s["error"])
        return
    for d in s["devices"]:
        print(f"  {d['device'][:60]}: {d['kernels_per_step']:.0f} kernels, busy {d['busy_us_per_step']:.0f} us, "
              f"span {d['span_us_per_step']:.0f} us, idle {d['idle_us_per_step']:.0f} us, collectives "
              f"{d['collective_us_per_step']:.0f} us in {d['collective_calls_per_step']:.0f} "
              f"({', '.join(k[:40] for k in d['collective_kernels'][:2])})")
        for k in d["top"][:8]:
            print(f"      {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['name'][:80]}")
        print("    idle between kernels, by the pair around it:")
        for g in d["gaps"][:8]:
            print(f"      {g['us_per_step']:8.1f} us  x{g['gaps_per_step']:5.1f}  {g['before'][:45]} -> {g['after'][:45]}")
    if s.get("host_in_gaps"):
        print("  host work during the first GPU's gaps of 20 us or more (overlap per step):")
        for k in s["host_in_gaps"][:10]:
            print(f"      {k['us_per_step']:8.1f} us  {100 * k['share_of_gaps']:5.1f}% of the gaps  {k['name'][:70]}")
    print("  host, by self time (all threads):")
    for k in s["host"][:15]:
        print(f"      {k['self_us_per_step']:8.1f} us self {k['us_per_step']:8.1f} total  x{k['calls_per_step']:5.1f}  "
              f"{k['name'][:70]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--steps", type=int, default=5, help="steps the trace holds")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = [summarise(d, args.steps) for d in args.dirs]
    for s in out:
        show(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
