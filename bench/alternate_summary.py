"""The constraint's cost over several processes: every `--alternate-constraint` record file under
the given folders (`bench/grammar_cost.sh OUT alternate`, one file per process), per file its
unconstrained and constrained output rates (means over its rounds) and the cost, then per folder
the mean, spread and range of the cost. One process's figure is not enough: the constrained
step is host-bound, and its cost spreads between processes far more than between the rounds of
one (bench/README.md, "Structured output").

    python3 bench/alternate_summary.py OUT [OUT ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec.bench.serve import constraint_rates  # noqa: E402


def process_costs(path: str) -> dict:
    """{off, on (mean output tok/s of each side), cost (on / off - 1), rounds} of one record file."""
    rates = constraint_rates([json.loads(line) for line in open(path) if line.strip()])
    if not rates["off"] or not rates["on"]:
        raise ValueError(f"{path}: no alternated runs (records without constraint off and on)")
    off, on = float(np.mean(rates["off"])), float(np.mean(rates["on"]))
    return {"off": off, "on": on, "cost": on / off - 1, "rounds": len(rates["on"])}


def summarize(folder: str) -> tuple[list[tuple[str, dict]], dict]:
    """(per file under folder: (its path relative to folder, `process_costs`), the cost's mean,
    sample sd, min and max over them)."""
    paths = sorted(glob.glob(os.path.join(folder, "**", "serve_grammar_alternate_c*.jsonl"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"{folder}: no serve_grammar_alternate_c*.jsonl")
    rows = [(os.path.relpath(p, folder), process_costs(p)) for p in paths]
    costs = np.array([r["cost"] for _, r in rows])
    return rows, {"processes": len(rows), "mean": float(costs.mean()),
                  "sd": float(costs.std(ddof=1)) if len(costs) > 1 else 0.0,
                  "min": float(costs.min()), "max": float(costs.max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    args = ap.parse_args(argv)
    for folder in args.folders:
        rows, total = summarize(folder)
        print(f"== {folder}")
        for name, r in rows:
            print(f"  {name}: off {r['off']:.1f}  on {r['on']:.1f}  cost {100 * r['cost']:+.1f}%  ({r['rounds']} rounds)")
        print(f"  cost over {total['processes']} processes: mean {100 * total['mean']:+.1f}%, sd {100 * total['sd']:.1f}, "
              f"range {100 * total['min']:+.1f}% .. {100 * total['max']:+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
