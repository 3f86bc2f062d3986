"""The scheduler alone on the generated-shared-prefix workload of a hybrid target (GDN snapshots):
32 groups x 16 prompts of a 2,048-token system prompt + 128 tokens, shuffled, all arriving at once,
512 running, chunks of 8,192 tokens. Plans every step until no prompt is left (no device: each
planned step counts as done) and reports the prompt steps, the prompt tokens they compute, the hit
rate and the host time spent planning. CPU, seconds.

With --decode N each request also decodes N tokens once its prompt is in and then finishes, so
that fewer running requests and snapshot rows than prompts (the engine's defaults: 128 and 128)
recycle slots and evict snapshots as a serving run does.

    PYTHONPATH=. python3 bench/gsp_schedule.py [--running 512 --rows 512 --decode 0] [--out OUT.jsonl]
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec.bench.record import append_jsonl, environment  # noqa: E402
from jspec.cache.allocator import PageAllocator, SlotAllocator  # noqa: E402
from jspec.cache.radix_cache import RadixCache  # noqa: E402
from jspec.models.batch import ForwardMode  # noqa: E402
from jspec.runtime.request import Request  # noqa: E402
from jspec.runtime.sampling_params import SamplingParams  # noqa: E402
from jspec.runtime.scheduler import Scheduler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--track-interval", type=int, default=256,
                    help="the engine's mamba_track_interval (snapshots inside prompt chunks; 0: none)")
    ap.add_argument("--running", type=int, default=512, help="max running requests (and request slots)")
    ap.add_argument("--rows", type=int, default=512, help="GDN snapshot rows of the prefix cache")
    ap.add_argument("--decode", type=int, default=0,
                    help="output tokens per request before it finishes (0: none finishes; prompts only)")
    args = ap.parse_args()
    PS = 16
    rng = random.Random(0)
    pages = PageAllocator(200000, PS)
    slots = args.running + 1  # slot 0 is the padding sink
    cache = RadixCache(pages, state_slots=list(range(slots, slots + args.rows)))
    sched = Scheduler(pages, SlotAllocator(slots), max_running_requests=args.running, chunked_prefill_size=8192,
                      max_extend_requests=64, max_decode_requests=args.running, radix_cache=cache,
                      prefix_pages_per_step=16384, track_interval=args.track_interval)
    reqs = []
    for g in range(32):
        system = [rng.randrange(1, 150000) for _ in range(2048)]
        for i in range(16):
            reqs.append(Request(rid=f"{g}-{i}", input_ids=system + [rng.randrange(1, 150000) for _ in range(128)],
                                sampling=SamplingParams(max_new_tokens=args.decode or 256), seed=0))
    rng.shuffle(reqs)
    for r in reqs:
        sched.add(r)
    t_plan, computed, steps, idle = 0.0, 0, 0, 0
    while sched.waiting or any(r.in_prefill for r in sched.running):
        t0 = time.perf_counter()
        plan = sched.schedule(inflight=False)
        t_plan += time.perf_counter() - t0
        if plan is None:  # nothing to run this step (a prompt waits one step for a snapshot)
            idle += 1
            assert idle < 1000, "the scheduler plans nothing"
            continue
        if plan.mode is ForwardMode.EXTEND:
            steps += 1
            computed += sum(s.num_tokens for s in plan.reqs if s.token_ids is not None)
        elif args.decode:
            for s in plan.reqs:  # the prompt's step sampled the first output token
                if s.req.scheduled_outputs >= args.decode:
                    sched.finish(s.req, {"type": "length"})
    rec = {"track_interval": args.track_interval, "running": args.running, "rows": args.rows, "decode": args.decode,
           "prompt_steps": steps, "prompt_tokens_computed": computed, "planning_ms": round(t_plan * 1e3, 1),
           "hit_rate": round(cache.hit_rate, 4)}
    print(json.dumps(rec))
    if args.out:
        append_jsonl(args.out, [{**rec, "env": environment()}])


if __name__ == "__main__":
    main()
