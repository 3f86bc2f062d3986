"""Host time of the scheduler's plans in a serving ramp: 32 prompts of 1,024 random tokens arrive at
once and are admitted in 2,048-token chunks while the admitted ones decode (a speculative engine:
every decode step accepts 3 tokens), with the prefix cache on (bigram keys, as an EAGLE-family
engine, and plain keys). The prompt steps' planning sits on the loop's critical path at the start of
a run (bench/README.md, "Structured output"); each admission looks the prompt up in the cache and
each chunk inserts its pages. No device: each planned step counts as done. CPU, milliseconds.

    PYTHONPATH=. python3 bench/schedule_cost.py [--prompts 32 --prompt-len 1024 --reps 5] [--out OUT.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec.bench.record import append_jsonl, environment  # noqa: E402
from jspec.cache.allocator import PageAllocator, SlotAllocator  # noqa: E402
from jspec.cache.radix_cache import RadixCache  # noqa: E402
from jspec.models.batch import ForwardMode  # noqa: E402
from jspec.runtime.request import Request  # noqa: E402
from jspec.runtime.sampling_params import SamplingParams  # noqa: E402
from jspec.runtime.scheduler import Scheduler  # noqa: E402

ACCEPT = 3  # tokens each decode step gives a request (simulated accept length 3)


def ramp(prompts: int, prompt_len: int, bigram: bool, seed: int) -> dict[str, list[float]]:
    """Plan the ramp once -> {"extend": ms per prompt step, "decode": ms per decode step}."""
    pages = PageAllocator(prompts * (prompt_len // 16 + 64) + 1, 16)
    sched = Scheduler(pages, SlotAllocator(prompts + 1), max_running_requests=prompts, chunked_prefill_size=2048,
                      max_extend_requests=prompts, max_decode_requests=prompts, spec_tokens=4, spec_max_accept=4,
                      radix_cache=RadixCache(pages, bigram=bigram), prefix_pages_per_step=256)
    rng = np.random.default_rng(seed)
    for i in range(prompts):
        sched.add(Request(rid=str(i), input_ids=rng.integers(10, 150_000, prompt_len).tolist(),
                          sampling=SamplingParams(max_new_tokens=1024), seed=i))
    out: dict[str, list[float]] = {"extend": [], "decode": []}
    while sched.waiting or any(r.in_prefill for r in sched.running):
        t = time.perf_counter()
        plan = sched.schedule(inflight=False)
        out[plan.mode.value].append((time.perf_counter() - t) * 1e3)
        for s in plan.reqs:  # the step's results, as the engine reads them
            req = s.req
            if plan.mode is ForwardMode.DECODE:
                req.output_ids += [5] * ACCEPT
                req.spec_inflight -= 1
                sched.accepted(req, ACCEPT)
                req.scheduled_outputs = len(req.output_ids)
            elif s.sample:
                req.output_ids.append(5)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5, help="ramps per key kind (the first is a warm-up)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    records = []
    for bigram in (True, False):
        times: dict[str, list[float]] = {"extend": [], "decode": []}
        for rep in range(args.reps + 1):
            got = ramp(args.prompts, args.prompt_len, bigram, rep)
            if rep:
                for kind in times:
                    times[kind] += got[kind]
        rec = {"bigram": bigram, "prompts": args.prompts, "prompt_len": args.prompt_len, "reps": args.reps,
               **{f"{k}_ms_median": float(np.median(v)) for k, v in times.items()},
               **{f"{k}_ms_max": float(np.max(v)) for k, v in times.items()},
               "extend_steps": len(times["extend"]) // args.reps,
               "command": " ".join(["bench/schedule_cost.py", *(argv if argv is not None else sys.argv[1:])])}
        print(json.dumps(rec))
        records.append(rec)
    if args.out:
        env = environment()
        append_jsonl(args.out, [{**r, "env": env} for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
