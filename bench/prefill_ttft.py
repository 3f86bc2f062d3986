"""Time to first token of long prompts through `Engine.generate`, one engine after the other in one
process, random bf16 weights of a preset shape. `--compare attention` (default): prompt chunks'
attention in two parts (cuDNN over the chunk's own tokens, the kernel over its cached prefix;
`ops.extend_attention`) against the kernel alone (the threshold `ops.PREFILL_CUDNN_MIN_TOKENS` set out
of reach). `--compare matmuls`: prompt steps' matmuls as XLA's autotuned Triton GEMM fusions against
cuBLAS's heuristic (`JSPEC_PROMPT_MATMULS`, `jspec.runtime.compile_options`), each engine's compile
seconds beside its TTFTs.

    PYTHONPATH=. python3 bench/prefill_ttft.py --preset qwen3-8b [--compare matmuls] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax

from jspec.api import Engine
from jspec.bench.record import environment
from jspec.config import parse_hf_config
from jspec.models import ops
from jspec.models.loader import random_model
from jspec.models.presets import preset_config
from jspec.runtime.compile_options import PROMPT_MATMULS_ENV

PROMPTS = (2048, 8192, 16384)  # one chunk of each bucket, then two 8192-token chunks (a cached prefix)


def ttfts(model, reps: int, buckets=(2048, 8192), prompts=PROMPTS):
    eng = Engine(model, page_size=16, cuda_graph_bs=[1], max_running_requests=4, chunked_prefill_size=8192,
                 prefill_token_buckets=list(buckets), context_length=20480, max_total_tokens=65536,
                 show_progress=False, compilation_cache_dir="none")
    v = model.config.vocab_size
    out = {"compile_s": eng.runner.compile_seconds, "compile_seconds_per_bucket": dict(eng.runner.compile_times)}
    try:
        sp = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
        for n in prompts:
            times = []
            for r in range(reps + 1):  # fresh ids each time: no prefix-cache hit; the first run warms
                ids = [(101 + 7 * i + 7919 * r + n) % v for i in range(n)]
                m = eng.generate(input_ids=ids, sampling_params=sp)["meta_info"]
                if r:
                    times.append(m["ttft"] * 1e3)
            out[f"ttft_ms_{n}"] = statistics.median(times)
            out[f"ttft_ms_{n}_all"] = times
    finally:
        eng.shutdown()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare", choices=("attention", "matmuls"), default="attention")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model = random_model(parse_hf_config(preset_config(args.preset)), dtype="bfloat16", seed=0, scale=0.02)
    jax.block_until_ready(jax.tree_util.tree_leaves(model.params))
    res = {"env": environment(), "preset": args.preset, "threshold": ops.PREFILL_CUDNN_MIN_TOKENS,
           "compare": args.compare}
    if args.compare == "matmuls":
        for label in ("autotune", "cublas", "autotune_again", "cublas_again"):
            os.environ[PROMPT_MATMULS_ENV] = label.split("_")[0]
            res[label] = ttfts(model, args.reps, buckets=(512, 2048, 8192), prompts=(512,) + PROMPTS)
            print(label, json.dumps({k: v for k, v in res[label].items() if not k.endswith("_all")}), flush=True)
        os.environ.pop(PROMPT_MATMULS_ENV)
        return _write(res, args.out)
    default = ops.PREFILL_CUDNN_MIN_TOKENS
    for label, threshold in (("kernel_only", 1 << 30), ("two_part", default), ("kernel_only_again", 1 << 30)):
        ops.PREFILL_CUDNN_MIN_TOKENS = threshold
        res[label] = ttfts(model, args.reps)
        print(label, json.dumps({k: v for k, v in res[label].items() if not k.endswith("_all")}), flush=True)
    ops.PREFILL_CUDNN_MIN_TOKENS = default
    _write(res, args.out)


def _write(res: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
