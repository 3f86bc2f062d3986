"""`jspec bench plot RESULTS.jsonl`: PNG charts from serve / sweep records.

- <stem>_throughput.png: output tokens/s vs max concurrency, one line per setting;
- <stem>_speedup.png: the same over the no-speculation run of each row;
- <stem>_accept_length.png: histogram of per-request accept lengths, one per setting.
A record without a concurrency cap is placed at its measured concurrency.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from jspec.bench.record import read_jsonl
from jspec.bench.sweep import attach_speedups
from jspec.errors import ConfigError


def series_label(rec: dict) -> str:
    sp = rec.get("speculative") or {}
    algo = sp.get("speculative_algorithm")
    label = "no spec" if not algo else algo
    if algo:
        knobs = [(k, sp.get(f"speculative_{n}")) for k, n in
                 (("s", "num_steps"), ("k", "eagle_topk"), ("n", "num_draft_tokens"),
                  ("acc", "simulate_accept_length"))]
        label += " " + " ".join(f"{k}{v}" for k, v in knobs if v is not None)
    if rec["engine_args"].get("disable_overlap_schedule"):
        label += " (no overlap)"
    return label.strip()


def _x(rec: dict) -> float:
    return rec["settings"].get("max_concurrency") or round(rec["metrics"]["concurrency"], 2)


def load_records(paths: list[str]) -> list[dict]:
    recs = []
    for p in paths:
        if not os.path.isfile(p):
            raise ConfigError(f"RESULTS {p!r}: no such file")
        recs += read_jsonl(p)
    ok = [r for r in recs if r.get("metrics") and r["metrics"].get("completed")]
    if not ok:
        raise ConfigError(f"RESULTS {', '.join(paths)}: no record with completed requests to plot")
    if any(r.get("speedup") is None for r in ok):
        attach_speedups(ok)  # serve records have none; a sweep's are already there
    return ok


def _line_chart(ax, series: dict, key: str, ylabel: str) -> None:
    for label, recs in sorted(series.items()):
        pts = sorted((_x(r), r.get(key) if key == "speedup" else r["metrics"][key]) for r in recs)
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    xs = {_x(r) for recs in series.values() for r in recs}
    if len(xs) > 1 and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def plot_results(paths: list[str], out_dir: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on benchmark machines or in CI
    import matplotlib.pyplot as plt

    recs = load_records(paths)
    out_dir = out_dir or os.path.dirname(os.path.abspath(paths[0]))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(paths[0]))[0]
    # Files may mix workloads: name the dataset then. A point measured twice keeps its latest record.
    many = len({r["settings"].get("dataset_name") for r in recs}) > 1
    latest = {}
    for r in recs:
        label = series_label(r) + (f" [{r['settings'].get('dataset_name')}]" if many else "")
        latest[(label, _x(r))] = r
    series = defaultdict(list)
    for (label, _), r in latest.items():
        series[label].append(r)
    title = f"{recs[0]['device']} - {os.path.basename(str(recs[0]['settings'].get('model_path')))}"
    written = []

    for name, key, ylabel in (("throughput", "output_throughput", "output tokens/s"),
                              ("speedup", "speedup", "speedup over no speculation")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _line_chart(ax, series, key, ylabel)
        if key == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(title)
        written.append(_save(fig, out_dir, f"{stem}_{name}.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    acc = {label: [a for r in rs for a in r.get("accept_lengths") or []] for label, rs in sorted(series.items())}
    hi = max([max(v) for v in acc.values() if v] + [2.0])
    bins = np.arange(1.0, np.ceil(hi) + 0.25, 0.25)
    for label, values in acc.items():
        if values:
            ax.hist(values, bins=bins, histtype="step", lw=1.5, label=f"{label} (n={len(values)})")
    ax.set_xlabel("accept length (tokens per verify pass; 1 without speculation)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    ax.legend(fontsize="small")
    written.append(_save(fig, out_dir, f"{stem}_accept_length.png"))
    return written


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
