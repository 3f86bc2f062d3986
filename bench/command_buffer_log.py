"""Summarise XLA's command-buffer log: which captured graphs were re-recorded, how often, at what
host cost, and how many buffer allocations had moved each time.

XLA re-records a graph before a launch when a buffer it uses has a new address
(bench/README.md, "a decode step whose graph is never re-recorded"). Run the workload under
`TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0`, keep its stderr, then

    python3 bench/command_buffer_log.py LOG OUT.json

Graphs are told apart by their command count. The first `--skip` timings of each graph (warm-up
records) are left out of its median.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics

UPDATE = re.compile(r"Create/Update command buffer.*num_commands=(\d+); updated_allocs=(\d+)")
TIMED = re.compile(r"(?:Updated|Recorded) command buffer in (\d+) .*num_commands=(\d+)")


def summarise(lines, skip: int = 5) -> dict:
    """{"graph_<commands>_commands": {"updates", "median_us", "updated_allocs": {moved: times}}}."""
    graphs = collections.defaultdict(lambda: {"updates": 0, "us": [], "allocs": collections.Counter()})
    for line in lines:
        if m := UPDATE.search(line):
            g = graphs[int(m.group(1))]
            g["updates"] += 1
            g["allocs"][m.group(2)] += 1
        elif m := TIMED.search(line):
            graphs[int(m.group(2))]["us"].append(int(m.group(1)))
    out = {}
    for n, g in sorted(graphs.items()):
        us = g["us"][skip:] or g["us"]
        out[f"graph_{n}_commands"] = {"updates": g["updates"], "median_us": statistics.median(us) if us else None,
                                      "updated_allocs": dict(g["allocs"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("out")
    ap.add_argument("--skip", type=int, default=5, help="first timings of each graph left out of its median")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        res = summarise(f, args.skip)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
