"""What an engine's start-up spends before XLA compiles: tracing and lowering every bucket's step
for CUDA with the Pallas kernels, measured on any machine (JAX lowers for a platform it does not
run on). A warm start with XLA's persistent cache alone pays exactly this (bench/README.md,
"Start-up"); the number of kernel custom calls in a bucket's module shows whether layers share
their kernels. `JSPEC_PALLAS_LOWERING_CACHE=0` measures it without the Triton lowering memo.

  PYTHONPATH=. python3 bench/lowering_cost.py --preset tiny-qwen3 --layers 36 --out $OUT/lowering.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from jspec.api import Engine
from jspec.bench.record import environment
from jspec.config import parse_hf_config
from jspec.models import dispatch
from jspec.models.loader import random_model
from jspec.models.presets import preset_config
from pallas_kernels import lowering_cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--model-path", default=None, help="a checkpoint instead of random weights (NEXTN needs its mtp layer)")
    ap.add_argument("--layers", type=int, default=None, help="repeat the preset's first layer type this many times")
    ap.add_argument("--engine-json", default='{"cuda_graph_bs": [1, 16], "prefill_token_buckets": [64]}')
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = parse_hf_config(preset_config(args.preset))
    if args.layers:
        n = args.layers
        cfg = dataclasses.replace(cfg, num_hidden_layers=n, layer_types=(cfg.layer_types[0],) * n,
                                  moe_layers=(cfg.moe_layers[0],) * n)
    model = args.model_path or random_model(cfg, dtype="bfloat16", seed=0, scale=0.02)
    kw = {"chunked_prefill_size": 64, "context_length": 256, "max_total_tokens": 2048, **json.loads(args.engine_json)}
    eng = Engine(model, dtype="bfloat16", show_progress=False, compilation_cache_dir="none", **kw)
    runner, rows = eng.runner, []
    lowering_cache.take()  # the counters of this loop's lowerings alone
    with dispatch.use_backend("pallas"):
        for b in runner.buckets:
            if b.grammar_split:
                continue
            t0 = time.perf_counter()
            traced = jax.jit(runner.step_fn(b), donate_argnums=(1,)).trace(
                runner.params, runner.state, jax.ShapeDtypeStruct((b.size,), jnp.int32))
            t1 = time.perf_counter()
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            t2 = time.perf_counter()
            rows.append({"bucket": b.label, "trace_s": t1 - t0, "lower_s": t2 - t1,
                         "custom_calls": text.count("stablehlo.custom_call")})
            print(f"{b.label:28s} trace {t1 - t0:6.3f} s  lower {t2 - t1:6.3f} s  "
                  f"custom calls {rows[-1]['custom_calls']}", flush=True)
    eng.shutdown()
    rec = {"preset": args.model_path or args.preset, "layers": eng.config.num_hidden_layers, "engine": kw, "buckets": rows,
           "total_s": sum(r["trace_s"] + r["lower_s"] for r in rows), "kernel_lowerings": lowering_cache.take(),
           "lowering_memo": os.environ.get(lowering_cache.ENV, "1") != "0", **environment(),
           "command": " ".join(sys.argv)}
    print(f"total {rec['total_s']:.2f} s over {len(rows)} buckets")
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
