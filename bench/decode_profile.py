"""Where a decode step's time goes: per-kernel GPU time from a jax.profiler (perfetto) trace.

For each (preset, batch, kernel backend) it times the compiled decode step (as bench/engine_decode.py
does) and aggregates the trace's GPU events by kernel name over a few steps.

The page table is as wide as the context unless `--table-tokens` widens it, as an engine's context
length does (the paged attention's KV split count follows the table's width).

Usage: python bench/decode_profile.py --out profile.json [--cases qwen3-8b:1:pallas,qwen3-8b:1:reference]
       [--table-tokens 8192] [--layers 4]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.72")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from bench.engine_decode import commit, log  # noqa: E402
from jspec.bench.step import (bytes_per_step, copy_bandwidth, decode_plan, fill_random_kv, page_table,  # noqa: E402
                              time_step)
from jspec.cache.pool import PoolLayout  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models import dispatch  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402
from jspec.runtime.model_runner import ModelRunner  # noqa: E402
from jspec.runtime.step_inputs import pack  # noqa: E402


def trace_events(trace_dir: str):
    """(file, events, pid -> process name, GPU pids) of the jax.profiler trace under trace_dir,
    or None when there is none."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return None
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pid_name = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pid_name.items() if "GPU" in n or "gpu" in n or "stream" in n.lower()}
    return files[0], events, pid_name, gpu_pids


def gpu_kernel_times(trace_dir: str, steps: int) -> dict:
    found = trace_events(trace_dir)
    if found is None:
        return {"error": f"no trace file under {trace_dir}: {glob.glob(trace_dir + '/**', recursive=True)[:20]}"}
    _, events, pid_name, gpu_pids = found
    by_name = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            by_name[e["name"]] += e["dur"]
            count[e["name"]] += 1
    total = sum(by_name.values())
    top = [{"name": n[:120], "us_per_step": us / steps, "calls_per_step": count[n] / steps}
           for n, us in by_name.most_common(30)]
    return {"gpu_busy_us_per_step": total / steps, "kernels_per_step": sum(count.values()) / steps,
            "top": top, "gpu_processes": [pid_name[p] for p in gpu_pids],
            "all_processes": sorted(set(pid_name.values()))[:40]}


def run_case(preset, batch, backend, context, copy_bps, models, table_tokens=0, layers=0):
    cfg = preset_config(preset)
    if layers:
        cfg["num_hidden_layers"] = layers
    cfg = parse_hf_config(cfg)
    if preset not in models:
        models.clear()
        models[preset] = random_model(cfg, dtype="bfloat16", seed=0, scale=0.02)
    model = models[preset]
    dispatch.set_backend(backend)
    page_size = 16
    # The page table is as wide as the engine's context length; the split count follows it.
    pages_per_seq = -(-max(context, table_tokens) // page_size)
    layout = PoolLayout(page_size=page_size, num_pages=batch * pages_per_seq + 1, num_slots=batch + 1,
                        pages_per_seq=pages_per_seq)
    runner = ModelRunner(model, layout=layout, decode_batch_sizes=[batch], extend_token_sizes=[],
                         max_extend_requests=1, progress=False)
    fill_random_kv(runner, jax.random.PRNGKey(3))
    bucket = runner.buckets[0]
    runner.state.req_to_page = page_table(batch, context, page_size, pages_per_seq, batch + 1)
    packed = jax.device_put(pack(decode_plan(batch, context), bucket))
    sec = time_step(runner, bucket, packed)
    floor = bytes_per_step(cfg, model, batch, context)["total"] / copy_bps
    res = {"preset": preset, "layers": cfg.num_hidden_layers, "batch": batch, "context": context, "table_tokens": pages_per_seq * page_size,
           "backend": backend,
           "compile_s": runner.compile_seconds, "ms_per_step": sec * 1e3, "floor_ms": floor * 1e3,
           "fraction_of_floor": floor / sec}
    log(f"{preset} B={batch} {backend}: {sec * 1e3:.3f} ms/step, floor {floor * 1e3:.3f} -> {floor / sec:.2f}")
    d = tempfile.mkdtemp(prefix="trace-")
    steps = 5
    fn = runner.compiled[bucket]
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(steps):
            runner.state, out = fn(runner.params, runner.state, packed)
        out.block_until_ready()
    res["profile"] = gpu_kernel_times(d, steps)
    prof = res["profile"]
    if "top" in prof:
        log(f"  GPU busy {prof['gpu_busy_us_per_step']:.0f} us/step in {prof['kernels_per_step']:.0f} kernels; top:")
        for k in prof["top"][:12]:
            log(f"    {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['name'][:90]}")
    else:
        log("  profile:", prof)
    del runner
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="qwen3-8b:1:pallas,qwen3-8b:1:reference,qwen3-next-12l:1:pallas,"
                                       "qwen3-next-12l:32:pallas")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--table-tokens", type=int, default=0,
                    help="page table width in tokens (an engine's context length); default: the context")
    ap.add_argument("--layers", type=int, default=0,
                    help="cut every preset to this many layers (a large model's layers on one GPU)")
    args = ap.parse_args(argv)
    results = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "commit": commit(),
               "command": "python " + " ".join(sys.argv), "cases": []}
    cp = copy_bandwidth()
    results["copy"] = cp
    models = {}
    for case in args.cases.split(","):
        preset, b, backend = case.split(":")
        try:
            results["cases"].append(run_case(preset, int(b), backend, args.context, cp["bytes_per_s"], models,
                                           args.table_tokens, args.layers))
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            results["cases"].append({"case": case, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    log("done")


if __name__ == "__main__":
    main()
