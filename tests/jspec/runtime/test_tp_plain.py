"""Tensor parallelism in the engine, no speculation: greedy output at tp_size 2 and 4 equals the
unsplit engine's for every target family (dense, MoE with an expert count that does not divide,
hybrid Gated DeltaNet with fused and split projections), with an odd vocabulary (97, padded) and
fewer KV heads than devices (replicated), experts split by intermediate dimension or whole
(expert parallelism); seeded sampling repeats; NGRAM runs on a split target; a repetition penalty
on a cached prompt gives the uncached output;
nothing leaks and the loop runs under the transfer guard; the token mixers replicated
(`replicate_attention`) give the same output with one all-reduce per layer fewer. Speculative algorithms on split targets:
tests/jspec/speculative/test_tp_spec.py. The session has 4 CPU devices (tests/conftest.py)."""

from __future__ import annotations

import jax
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
            if family == "llama":  # the sampler's vocabulary reductions are all-reduces (ops.vocab_argmax),
                # and prompt steps update the per-slot penalty state whole (dispatch.whole)
                gathers = [line for b, e in eng.runner.compiled.items() if not b.sort
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


def _decode_all_reduces(eng) -> list[int]:
    return [sum(" all-reduce(" in line or " all-reduce-start(" in line for line in exe.as_text().splitlines())
            for bucket, exe in eng.runner.compiled.items() if bucket.mode.value == "decode"]


def test_replicated_attention_greedy_equals_unsplit(tiny_checkpoint, greedy_reference):
    """`replicate_attention`: the token mixers (and their KV / GDN pools) whole on every device, the
    MLP / MoE and the vocabulary split. Greedy output equals the unsplit engine's; a decode step
    has one all-reduce per layer fewer than the fully split one (no reduction after o_proj); GDN
    heads that tp_size does not divide (2 key heads, tp 4) are fine since they are not split;
    device 0 holds every mixer parameter whole and a 1/tp slice of the rest."""
    llama = tiny_checkpoint("llama", 44)
    want = greedy_reference(llama, PROMPTS, GREEDY, page_size=4, settings=SPEC_BS4)
    counts = {}
    for rep in (False, True):
        eng = Engine(llama, page_size=4, tp_size=2, replicate_attention=rep, **BASE)
        try:
            assert eng.get_server_info()["replicate_attention"] is rep
            generates(eng, PROMPTS, GREEDY, want)
            counts[rep] = _decode_all_reduces(eng)
            check_no_leaks(eng)
        finally:
            eng.shutdown()
    layers = eng.config.num_hidden_layers
    assert counts[True] == [n - layers for n in counts[False]], counts

    nxt = tiny_checkpoint("qwen3_next", 5)
    want = greedy_reference(nxt, PROMPTS, GREEDY, page_size=4, settings=SPEC_BS4)
    eng = Engine(nxt, page_size=4, tp_size=4, replicate_attention=True, **BASE)
    try:
        generates(eng, PROMPTS, GREEDY, want)
        check_no_leaks(eng)
        for path, leaf in jax.tree_util.tree_leaves_with_path(eng.model.params):
            name = ".".join(str(getattr(k, "key", k)) for k in path)
            whole = leaf.sharding.shard_shape(leaf.shape) == leaf.shape
            if ".self_attn." in name or ".linear_attn." in name:
                assert whole, name
            elif name.endswith(("mlp.experts.down_proj", "embed_tokens.weight")):
                assert not whole, name
        for pool in jax.tree.leaves(eng.runner.state.caches):
            assert pool.sharding.shard_shape(pool.shape) == pool.shape
    finally:
        eng.shutdown()
