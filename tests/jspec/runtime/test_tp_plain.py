"""Tensor parallelism in the engine, no speculation: greedy output at tp_size 2 and 4 equals the
unsplit engine's for every target family (dense, MoE with an expert count that does not divide,
hybrid Gated DeltaNet with fused and split projections), with an odd vocabulary (97, padded) and
fewer KV heads than devices (replicated), experts split by intermediate dimension or whole
(expert parallelism); seeded sampling repeats; NGRAM runs on a split target; a repetition penalty
on a cached prompt gives the uncached output;
nothing leaks and the loop runs under the transfer guard. Speculative algorithms on split targets:
tests/jspec/speculative/test_tp_spec.py. The session has 4 CPU devices (tests/conftest.py)."""

from __future__ import annotations

import pytest

from jspec import Engine
from tests.support import models as tm
from tests.support.engines import SPEC_BS4, check_no_leaks, generates, output_ids

BASE = {**SPEC_BS4, "transfer_guard": "disallow"}
PROMPTS = [tm.random_ids(n, seed=400 + n) for n in (6, 17, 1, 11)]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 10, "temperature": 0.9, "seed": 3, "ignore_eos": True}


@pytest.mark.parametrize("family,seed,tps,ep", [
    ("llama", 44, (2, 4), False),  # 2 KV heads: replicated at tp 4; untied lm_head, vocabulary 97 -> 100
    ("qwen3_moe", 3, (4,), False),  # 8 experts of 24 -> 6 per device; a dense layer beside the MoE ones
    ("qwen3_moe", 3, (4,), True),  # expert parallelism: 2 whole experts per device
    ("qwen3_next", 5, (2,), False),  # hybrid: GDN by key / value heads, conv channels, MoE + shared expert
    ("qwen3_5_moe", 3, (2,), True),  # hybrid with split GDN projections (in_proj_qkv permuted on load), EP
])
def test_split_target_greedy_equals_unsplit(tiny_checkpoint, greedy_reference, family, seed, tps, ep):
    path = tiny_checkpoint(family, seed)
    want = greedy_reference(path, PROMPTS, GREEDY, page_size=4, settings=SPEC_BS4)
    for tp in tps:
        eng = Engine(path, page_size=4, tp_size=tp, ep_size=tp if ep else None, **BASE)
        try:
            info = eng.get_server_info()
            assert info["tp_size"] == tp and info["ep_size"] == (tp if ep else 1)
            generates(eng, PROMPTS, GREEDY, want)
            check_no_leaks(eng)
            if family == "llama":  # the sampler's vocabulary reductions are all-reduces (ops.vocab_argmax)
                gathers = [line for b, e in eng.runner.compiled.items() if b.mode.value == "decode"
                           for line in e.as_text().splitlines() if " all-gather(" in line]
                assert not gathers, gathers[:1]
        finally:
            eng.shutdown()


def test_split_target_samples_repeatably_and_runs_ngram(tiny_checkpoint, greedy_reference):
    """Seeded sampling gives the same text twice on a split engine (its keys do not depend on the
    split); NGRAM (device-side drafts from the request's own tokens) equals greedy on it."""
    path = tiny_checkpoint("qwen3_moe", 3)
    want = greedy_reference(path, PROMPTS, GREEDY, page_size=4, settings=SPEC_BS4)
    eng = Engine(path, page_size=4, tp_size=2, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, **BASE)
    try:
        generates(eng, PROMPTS, GREEDY, want)
        a = output_ids(eng.generate(input_ids=PROMPTS[:2], sampling_params=SAMPLED))
        b = output_ids(eng.generate(input_ids=PROMPTS[:2], sampling_params=SAMPLED))
        assert a == b
        # A repetition penalty on a cached prompt: the slot's split penalty state is seeded with it.
        rep = {**GREEDY, "repetition_penalty": 1.8}
        assert eng.flush_cache()
        uncached = eng.generate(input_ids=PROMPTS[1], sampling_params=rep)
        cached = eng.generate(input_ids=PROMPTS[1], sampling_params=rep)
        assert cached["meta_info"]["cached_tokens"] > 0 and cached["output_ids"] == uncached["output_ids"]
        check_no_leaks(eng)
    finally:
        eng.shutdown()
