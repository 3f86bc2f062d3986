"""Speculative step cost vs a plain decode step (same run, same weights, same KV).

With NGRAM the drafts are matched on the device without a draft model, so the compiled
speculative step is n-gram matching, verify (target forward over S + 1 tokens per request) and
greedy acceptance: this isolates what verification adds over one decode step. Random bf16 weights, random KV, context 1024.

Usage: python bench/spec_step.py --out spec_step.json [--preset qwen3-8b] [--batches 1,8,32] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.72")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.engine_decode import commit, log  # noqa: E402
from jspec.bench.step import decode_plan, fill_random_kv, page_table, time_step  # noqa: E402
from jspec.cache.pool import PoolLayout  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402
from jspec.runtime.model_runner import ModelRunner  # noqa: E402
from jspec.runtime.step_inputs import pack  # noqa: E402
from jspec.speculative.algorithms import make_drafting  # noqa: E402
from jspec.speculative.config import SpecConfig  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = parse_hf_config(preset_config(args.preset))
    model = random_model(cfg, dtype="bfloat16", seed=0, scale=0.02)
    page_size, ctx = 16, args.context
    # Timed speculative steps move each request on by its accept length on the device: a margin.
    margin = 2 * args.steps + 2 + 512
    pages_per_seq = -(-(ctx + margin) // page_size)
    num_pages = max(batches) * pages_per_seq + 1
    spec = SpecConfig(algorithm="NGRAM", num_steps=args.steps, topk=1, num_draft_tokens=args.steps + 1,
                      draft_model_path=None)
    res = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "commit": commit(),
           "command": "python " + " ".join(sys.argv), "preset": args.preset, "context": ctx, "points": []}
    runners = {}
    for name, sp in (("decode", None), ("spec", spec)):
        layout = PoolLayout(page_size=page_size, num_pages=num_pages, num_slots=max(batches) + 1,
                            pages_per_seq=pages_per_seq)
        runners[name] = ModelRunner(model, layout=layout, decode_batch_sizes=batches, extend_token_sizes=[],
                                    max_extend_requests=1, progress=False,
                                    drafting=None if sp is None else make_drafting(sp, model, None))
        fill_random_kv(runners[name], jax.random.PRNGKey(5))
        log(f"{name}: compiled {len(runners[name].buckets)} buckets in {runners[name].compile_seconds:.1f}s")
    for b in batches:
        point = {"batch": b}
        for name, r in runners.items():
            bucket = next(x for x in r.buckets if x.batch_size == b)
            r.state.req_to_page = page_table(b, ctx + margin, page_size, pages_per_seq, max(batches) + 1)
            if r.state.seq_lens is not None:  # speculative steps read each request's length on the device
                r.state.seq_lens = jnp.zeros_like(r.state.seq_lens).at[1:b + 1].set(ctx - 1)
            plan = decode_plan(b, ctx)
            sec = time_step(r, bucket, jax.device_put(pack(plan, bucket)))
            point[f"{name}_ms"] = sec * 1e3
        point["spec_over_decode"] = point["spec_ms"] / point["decode_ms"]
        res["points"].append(point)
        log(f"B={b}: decode {point['decode_ms']:.3f} ms, verify step (S={args.steps}) {point['spec_ms']:.3f} ms "
            f"-> {point['spec_over_decode']:.3f}x")
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
