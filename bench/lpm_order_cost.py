"""Host cost of `--schedule-policy lpm`: how long `Scheduler._order_by_prefix` takes to order a
waiting queue of generated-shared-prefix prompts against a tree that caches every group's prefix.
Runs on the host alone (no device): python3 bench/lpm_order_cost.py [--groups 32] [--waiting 128]."""

from __future__ import annotations

import argparse
import random
import time

from jspec.cache.allocator import PageAllocator, SlotAllocator
from jspec.cache.radix_cache import RadixCache
from jspec.runtime.request import Request
from jspec.runtime.sampling_params import SamplingParams
from jspec.runtime.scheduler import Scheduler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--waiting", type=int, default=128)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    rng = random.Random(0)
    prompt_pages = (a.system_len + a.question_len) // a.page_size
    pages = PageAllocator(a.groups * prompt_pages + 2, a.page_size)
    cache = RadixCache(pages)
    systems = [[rng.randrange(150_000) for _ in range(a.system_len)] for _ in range(a.groups)]
    for system in systems:  # each group's first prompt, cached
        ids = system + [rng.randrange(150_000) for _ in range(a.question_len)]
        held = pages.alloc(len(ids) // a.page_size)
        cache.insert(ids, held)
        pages.free(held)
    sched = Scheduler(pages, SlotAllocator(a.waiting + 1), max_running_requests=a.waiting, chunked_prefill_size=8192,
                      max_extend_requests=a.waiting, max_decode_requests=a.waiting, radix_cache=cache,
                      prefix_pages_per_step=prompt_pages, schedule_policy="lpm")
    for i in range(a.waiting):
        ids = systems[i % a.groups] + [rng.randrange(150_000) for _ in range(a.question_len)]
        sched.add(Request(rid=str(i), input_ids=ids, sampling=SamplingParams(max_new_tokens=1), seed=0))
    t0 = time.perf_counter()
    for _ in range(a.repeats):
        sched.waiting = sched.reuse.order(sched.waiting)
    ms = (time.perf_counter() - t0) / a.repeats * 1e3
    print(f"order {a.waiting} waiting prompts ({prompt_pages} pages each, {a.groups} cached groups): {ms:.2f} ms")


if __name__ == "__main__":
    main()
