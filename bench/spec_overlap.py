"""Spec v2 (overlap) against spec v1, and drafters against each other, end to end through
`Engine.generate` on real shapes with random bf16 weights and simulated acceptance.

Rows (each: tokens/s of `batch` requests of 128-token prompts and `new_tokens` outputs, timed
after a warm-up generate on the same engine):
- no speculation, and EAGLE3 / NEXTN / NGRAM (3/1/4) at simulated accept length 3, v1 and v2;
- DFLASH (block 16, 5 random layers) at simulated accept length 6, v1 and v2, with EAGLE3 beside it;
- NAIVE_EAGLE (an EAGLE3 head, 2 tokens per step) against EAGLE3 with steps 1, at the same
  simulated accept length (1.7), v2.
A profiler trace of a few overlapped steps: each host dispatch (`jspec.dispatch` annotations)
is checked against the GPU's busy intervals, so the summary says how much of the host work of
step N+1 ran while the device still executed step N.

Usage: python bench/spec_overlap.py --out spec_overlap.json --targets qwen3-8b:EAGLE3 --batches 1,8,32,128
       [--dflash-batches 1,32] [--naive-batches 64,128] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.decode_profile import trace_events  # noqa: E402
from bench.engine_decode import commit, log  # noqa: E402
from jspec import Engine  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models.drafters.loader import random_drafter  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402

PROMPT = 128
CACHE = "/tmp/jspec-overlap-cache"  # one persistent compilation cache: v1 and v2 share executables


def generate_rate(model, batch, new_tokens, spec: dict, trace_dir: str | None = None) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, min(1000, model.config.vocab_size), PROMPT).tolist() for _ in range(batch)]
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    eng = Engine(model, cuda_graph_bs=[batch], max_running_requests=batch, context_length=1024,
                 max_total_tokens=batch * (PROMPT + new_tokens + 128) + 256, chunked_prefill_size=256,
                 prefill_token_buckets=[256], show_progress=False, compilation_cache_dir=CACHE, **spec)
    try:
        eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=24))  # warm
        t = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sp)
        sec = time.perf_counter() - t
        n = sum(len(o["output_ids"]) for o in outs)
        rec = {"tokens_per_s": n / sec, "seconds": sec, "tokens": n}
        if spec:
            rec["avg_spec_accept_length"] = eng.get_server_info()["avg_spec_accept_length"]
        if trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=24))
    finally:
        eng.shutdown()
    return rec


def overlap_summary(trace_dir: str) -> dict:
    """Host dispatches of spec steps against the GPU's busy time, from a perfetto trace."""
    found = trace_events(trace_dir)
    if found is None:
        return {"error": f"no trace under {trace_dir}"}
    file, events, names, gpu = found
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e)
    busy = []  # merged GPU busy intervals
    for s, t in kernels:
        if busy and s <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], t)
        else:
            busy.append([s, t])
    dispatches = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                        if e.get("ph") == "X" and str(e.get("name", "")).startswith("jspec.dispatch spec"))

    def covered(s, t):
        return sum(max(0.0, min(t, b) - max(s, a)) for a, b in busy if a < t and b > s)

    rows = [{"start_us": s, "host_us": t - s, "gpu_busy_during_us": covered(s, t)} for s, t, _ in dispatches]
    host = sum(r["host_us"] for r in rows)
    span = (busy[-1][1] - busy[0][0]) if busy else 0.0
    return {"trace_file": os.path.relpath(file, trace_dir), "spec_dispatches": len(rows),
            "host_dispatch_us_total": host,
            "fraction_of_dispatch_time_with_gpu_busy": (sum(r["gpu_busy_during_us"] for r in rows) / host) if host else None,
            "gpu_busy_fraction_of_span": (sum(b - a for a, b in busy) / span) if span else None,
            "gpu_processes": sorted(names[p] for p in gpu), "dispatches": rows[:40],
            "kernel_count": len(kernels), "event_names_sample": sorted(collections.Counter(
                e.get("name") for e in events if e.get("ph") == "X").most_common(5))}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--targets", default="qwen3-8b:EAGLE3")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dflash-batches", default="")
    ap.add_argument("--naive-batches", default="")
    ap.add_argument("--trace-dir", default="")
    ap.add_argument("--budget-s", type=float, default=0, help="start no new row after this many seconds")
    args = ap.parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "commit": commit(),
           "command": "python " + " ".join(sys.argv), "prompt_len": PROMPT, "new_tokens": args.new_tokens, "rows": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)

    t_start = time.perf_counter()

    def row(preset, b, name, model, spec, **kw):
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            log(f"{preset} B={b} {name}: skipped (--budget-s {args.budget_s:.0f} spent)")
            raise TimeoutError
        log(f"{preset} B={b} {name} ...")
        rec = generate_rate(model, b, args.new_tokens, spec, **kw)
        rec.update(preset=preset, batch=b, config=name)
        res["rows"].append(rec)
        log(f"{preset} B={b} {name}: {rec['tokens_per_s']:.1f} tok/s"
            + (f" (accept {rec['avg_spec_accept_length']:.2f})" if "avg_spec_accept_length" in rec else ""))
        save()
        return rec

    try:
        run_targets(args, res, row, save)
    except TimeoutError:
        res["stopped_early"] = f"--budget-s {args.budget_s} spent"
    save()


def run_targets(args, res, row, save):
    for item in args.targets.split(","):
        preset, algo = item.split(":")
        cfg = parse_hf_config(preset_config(preset))
        model = random_model(cfg, dtype="bfloat16", seed=0, scale=0.02)
        shape = dict(draft_vocab_size=min(32000, cfg.vocab_size)) if algo == "EAGLE3" else {}
        drafter = None if algo == "NGRAM" else random_drafter(algo, model, dtype="bfloat16", seed=1, **shape)
        chain = dict(speculative_algorithm=algo, speculative_num_steps=3, speculative_eagle_topk=1,
                     speculative_num_draft_tokens=4, speculative_simulate_accept_length=3.0)
        if drafter is not None:
            chain["speculative_draft_model_path"] = drafter
        for b in [int(x) for x in args.batches.split(",") if x]:
            base = row(preset, b, "no_spec", model, {})
            v1 = row(preset, b, f"{algo}_sim3_v1", model, dict(chain, disable_overlap_schedule=True))
            trace = args.trace_dir and b == 1
            v2 = row(preset, b, f"{algo}_sim3_v2", model, chain,
                     trace_dir=os.path.join(args.trace_dir, f"{preset}_b1") if trace else None)
            res.setdefault("summary", {})[f"{preset}_{algo}_b{b}"] = {
                "v2_over_v1": v2["tokens_per_s"] / v1["tokens_per_s"],
                "v1_over_no_spec": v1["tokens_per_s"] / base["tokens_per_s"],
                "v2_over_no_spec": v2["tokens_per_s"] / base["tokens_per_s"]}
            if trace:
                res.setdefault("overlap_trace", {})[preset] = overlap_summary(os.path.join(args.trace_dir,
                                                                                           f"{preset}_b1"))
                log("overlap:", {k: v for k, v in res["overlap_trace"][preset].items() if k != "dispatches"})
            save()
        if algo == "EAGLE3" and args.dflash_batches:
            dflash = random_drafter("DFLASH", model, dtype="bfloat16", seed=2, block_size=16)
            blk = dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=16,
                       speculative_draft_model_path=dflash, speculative_simulate_accept_length=6.0)
            for b in [int(x) for x in args.dflash_batches.split(",")]:
                d1 = row(preset, b, "DFLASH16_sim6_v1", model, dict(blk, disable_overlap_schedule=True))
                d2 = row(preset, b, "DFLASH16_sim6_v2", model, blk)
                e3 = [r for r in res["rows"] if r["preset"] == preset and r["batch"] == b
                      and r["config"] == f"{algo}_sim3_v2"]
                s = res.setdefault("summary", {})[f"{preset}_DFLASH16_b{b}"] = {
                    "v2_over_v1": d2["tokens_per_s"] / d1["tokens_per_s"]}
                if e3:
                    s["dflash_sim6_over_eagle3_sim3"] = d2["tokens_per_s"] / e3[0]["tokens_per_s"]
                save()
        if algo == "EAGLE3" and args.naive_batches:
            one = dict(speculative_draft_model_path=drafter, speculative_simulate_accept_length=1.7)
            for b in [int(x) for x in args.naive_batches.split(",")]:
                naive = row(preset, b, "NAIVE_EAGLE_sim1.7_v2", model, dict(one, speculative_algorithm="NAIVE_EAGLE"))
                e1 = row(preset, b, "EAGLE3_s1_sim1.7_v2", model,
                         dict(one, speculative_algorithm="EAGLE3", speculative_num_steps=1, speculative_eagle_topk=1,
                              speculative_num_draft_tokens=2))
                res.setdefault("summary", {})[f"{preset}_naive_b{b}"] = {"naive_over_eagle3_steps1": naive["tokens_per_s"]
                                                          / e1["tokens_per_s"]}
                save()
        del model, drafter


if __name__ == "__main__":
    main()
