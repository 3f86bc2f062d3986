"""The JSONL record of a run and its human-readable table.

A record holds everything needed to reproduce and compare a number: the command line, every
benchmark flag, the engine arguments and the engine's own view of them (server info), the device,
the JAX version and the commit (with a dirty flag, since benchmarks often run on uncommitted work).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - an installed copy has no git checkout
        return None


def environment() -> dict:
    import jax

    dev = jax.devices()[0]
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "device": str(dev.device_kind),
        "platform": dev.platform,
        "num_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "python": sys.version.split()[0],
        # $JSPEC_COMMIT names the tree when it was copied to a machine without (or with a stale) .git.
        "commit": os.environ.get("JSPEC_COMMIT") or _git("rev-parse", "HEAD") or "unknown",
        "commit_dirty": None if status is None or os.environ.get("JSPEC_COMMIT") else bool(status),
        # Compiler and collective settings change step times (e.g. XLA's one-shot all-reduce kernel).
        "xla_nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "NCCL_"))},
        # jspec's own knobs read from the environment (uncaptured split parts, the GIL switch
        # interval, ...): a run under one is not the default engine.
        "jspec_env": {k: v for k, v in os.environ.items() if k.startswith("JSPEC_") and k != "JSPEC_COMMIT"},
    }


def make_record(kind: str, command: str, settings: dict, engine_args: dict, env: dict, **fields) -> dict:
    return {
        "kind": kind,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        **env,
        "settings": settings,
        "engine_args": engine_args,
        **fields,
    }


def append_jsonl(path: str, records: list[dict]) -> None:
    # Appends, as SGLang's --output-file does, so repeated runs accumulate in one file.
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def serve_table(rec: dict) -> str:
    """SGLang's 'Serving Benchmark Result' block."""
    s, m = rec["settings"], rec["metrics"]
    rows = [
        ("Model:", rec["engine_args"].get("model_path")),
        ("Device:", f"{rec['device']} (JAX {rec['jax_version']})"),
        ("Dataset:", s["dataset_name"]),
        ("Traffic request rate:", s["request_rate"]),
        ("Max request concurrency:", s.get("max_concurrency") or "not set"),
        ("Speculative algorithm:", (rec.get("speculative") or {}).get("speculative_algorithm") or "none"),
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Benchmark duration (s):", m["duration_s"]),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", m["request_throughput"]),
        ("Input token throughput (tok/s):", m["input_throughput"]),
        ("Output token throughput (tok/s):", m["output_throughput"]),
        ("Peak output token throughput (tok/s):", m["peak_output_throughput"]),
        ("Total token throughput (tok/s):", m["total_throughput"]),
        ("Concurrency:", m["concurrency"]),
        ("Accept length:", m["accept_length"]),
        ("Prefix cache hit rate:", m.get("cache_hit_rate", 0.0)),
    ]
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<44} {fmt(v)}" for k, v in rows]
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-Token Latency", "ITL"), "e2e_latency": ("End-to-End Latency", "E2E Latency")}
    for name, (title, short) in titles.items():
        lines.append("{:-^60}".format(title))
        for stat in ("mean", "median", "p95", "p99", "max"):
            lines.append(f"{f'{stat.capitalize()} {short} (ms):':<44} {fmt(m[f'{stat}_{name}_ms'])}")
    lines.append("=" * 60)
    if rec.get("errors"):
        lines.append("errors: " + "; ".join(rec["errors"]))
    return "\n".join(lines)
