"""The bucket list (`jspec.runtime.bucket_set`) and the order its steps compile in: a bucket that
differs from another only in its sampler (its twin) compiles after it where XLA autotunes matmuls,
so that the process-wide autotuning cache serves the twin's tuned matmuls."""

from __future__ import annotations

import threading
import time

from jspec.api import Engine
from jspec.cache.pool import PoolLayout
from jspec.models.batch import ForwardMode
from jspec.runtime import compile_options, model_runner
from jspec.runtime.bucket_set import sampler_twins, step_buckets
from jspec.tiny import tiny_dir

LAYOUT = PoolLayout(page_size=4, num_pages=33, num_slots=5, pages_per_seq=8)


def buckets(**kw):
    return step_buckets(1000, LAYOUT, None, decode_batch_sizes=[1, 4], extend_token_sizes=[16, 32],
                        max_extend_requests=4, **kw)


def test_sampler_twins_pair_the_sort_and_input_logprob_variants_with_the_plain_one():
    bs = buckets(input_logprobs=True)
    twins = sampler_twins(bs)
    decode = [b for b in bs if b.mode is ForwardMode.DECODE]
    extend = [b for b in bs if b.mode is ForwardMode.EXTEND]
    assert {b: twins.get(b) for b in decode if b.sort} == {
        b: next(t for t in decode if t.batch_size == b.batch_size and t.sort is False) for b in decode if b.sort}
    assert all(b not in twins for b in decode if not b.sort)
    for b in extend:
        assert twins.get(b) == (next(t for t in extend if t.num_tokens == b.num_tokens and not t.input_logprobs)
                                if b.input_logprobs else None)
    assert all(t in bs and t not in twins for t in twins.values())  # a twin waits for nothing
    assert sampler_twins(buckets(top_k_top_p=False)) == {}  # one variant each: nothing to pair


def test_a_twin_compiles_after_the_bucket_it_shares_its_matmuls_with(monkeypatch):
    """As on a GPU: each bucket with a twin starts compiling only once its twin has finished; every
    bucket compiles and the engine serves."""
    monkeypatch.setattr(compile_options, "autotunes_matmuls", lambda platform: True)
    monkeypatch.setattr(model_runner.os, "cpu_count", lambda: 8)  # a thread for every bucket
    spans, lock, compiled = {}, threading.Lock(), model_runner.ModelRunner._compiled_parts

    def timed(self, bucket, state, lowered=None, cached=True):
        t0 = time.perf_counter()
        if bucket.mode is ForwardMode.DECODE and not bucket.sort:
            time.sleep(3)  # a slow twin: the bucket waiting for it is traced (and would start) meanwhile
        parts = compiled(self, bucket, state, lowered, cached)
        with lock:
            spans[bucket] = (t0, time.perf_counter())
        return parts

    monkeypatch.setattr(model_runner.ModelRunner, "_compiled_parts", timed)
    with Engine(tiny_dir("qwen3"), dtype="float32", cuda_graph_bs=[1, 2], max_running_requests=2,
                chunked_prefill_size=16, context_length=64, show_progress=False,
                compilation_cache_dir="none") as eng:
        twins = sampler_twins(eng.runner.buckets)
        assert set(eng.runner.compiled) == set(eng.runner.buckets)
        out = eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 4, "temperature": 0.0,
                                                                  "ignore_eos": True})
    assert len(twins) == 2  # the sort variants of batch 1 and 2
    for b, twin in twins.items():
        assert spans[twin][1] <= spans[b][0], (b.label, twin.label)
    assert len(out["output_ids"]) == 4
