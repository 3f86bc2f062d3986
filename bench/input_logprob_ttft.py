"""What input logprobs add to a prompt: time to first token through `Engine.generate` of fresh
prompts (no prefix-cache hit) without logprobs, with the prompt's logprobs from position 0, and
with those plus top logprobs, alternated on one engine (`enable_input_logprobs=True`: its prompt
buckets have an input-logprob variant), random bf16 weights of a preset shape. One engine per
value of `--block-bytes` (`step.INPUT_LOGPROB_BYTES`: the float32 logits live at once, which sets
the tokens per block). `--profile DIR`: a trace of one prompt of each kind per engine, for
bench/trace_summary.py.

    PYTHONPATH=. python3 bench/input_logprob_ttft.py --preset qwen3-8b --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax

from jspec.api import Engine
from jspec.bench.record import environment
from jspec.config import parse_hf_config
from jspec.models.loader import random_model
from jspec.models.presets import preset_config
from jspec.runtime import step

KINDS = {"none": {}, "input": {"logprob_start_len": 0}, "input_top5": {"logprob_start_len": 0, "top_logprobs_num": 5}}


def measure(model, prompts: list[int], bucket: int, reps: int, profile: str | None) -> dict:
    eng = Engine(model, page_size=16, cuda_graph_bs=[1], max_running_requests=4, chunked_prefill_size=bucket,
                 prefill_token_buckets=[bucket], context_length=2 * bucket, enable_input_logprobs=True,
                 disable_top_k_top_p=True, show_progress=False, compilation_cache_dir="none")
    v = model.config.vocab_size
    sp = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    seq = iter(range(1 << 30))

    def ttft(n: int, kind: str) -> float:
        r = next(seq)  # fresh ids each time: no prefix-cache hit
        ids = [(101 + 7 * i + 7919 * r + n) % v for i in range(n)]
        return eng.generate(input_ids=ids, sampling_params=sp, **KINDS[kind])["meta_info"]["ttft"]

    out = {"compile_s": eng.runner.compile_seconds, "prompts": {}}
    try:
        for n in prompts:
            for kind in KINDS:  # warm-up: every variant once
                ttft(n, kind)
            times = {kind: [] for kind in KINDS}
            for _ in range(reps):  # alternated, so drift spreads over every kind alike
                for kind in KINDS:
                    times[kind].append(ttft(n, kind))
            out["prompts"][n] = {kind: {"median_ms": statistics.median(t) * 1e3, "ms": [x * 1e3 for x in t]}
                                 for kind, t in times.items()}
            if profile:
                for kind in KINDS:
                    with jax.profiler.trace(f"{profile}/t{n}_{kind}", create_perfetto_trace=True):
                        ttft(n, kind)
    finally:
        eng.shutdown()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--prompts", default="1024,2048", help="prompt lengths (tokens), each one chunk")
    ap.add_argument("--bucket", type=int, default=2048, help="the prompt bucket and chunk size")
    ap.add_argument("--block-bytes", default=str(step.INPUT_LOGPROB_BYTES),
                    help="values of step.INPUT_LOGPROB_BYTES, one engine each")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", help="write a trace per prompt kind under DIR/<block bytes>/")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model = random_model(parse_hf_config(preset_config(args.preset)), dtype="bfloat16")
    prompts = [int(x) for x in args.prompts.split(",")]
    res = {**environment(), "preset": args.preset, "bucket": args.bucket, "engines": {}}
    for budget in [int(x) for x in args.block_bytes.split(",")]:
        step.INPUT_LOGPROB_BYTES = budget
        rows = step.input_logprob_block(model.config.vocab_size)
        r = measure(model, prompts, args.bucket, args.reps, args.profile and f"{args.profile}/{budget}")
        res["engines"][budget] = {"block_tokens": rows, **r}
        for n, kinds in r["prompts"].items():
            base = kinds["none"]["median_ms"]
            print(f"blocks of {rows} tokens, prompt {n}: " + ", ".join(
                f"{k} {v['median_ms']:.2f} ms ({v['median_ms'] - base:+.2f})" for k, v in kinds.items()))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
