"""EAGLE, EAGLE3 and NEXTN (MTP) speculative decoding, chain and tree: greedy output equal to
non-speculative greedy output (random drafters in their published formats, which almost never
agree, and "agreeing" drafters built to match a near-bigram target, which almost always do), exact
sampling through a tree, simulated acceptance, settings errors, no leaks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import tiny_drafters as td  # noqa: E402
import tiny_models as tm  # noqa: E402
from spec_checks import leak_free, second_token_follows_target  # noqa: E402

from jspec import Engine  # noqa: E402
from jspec.errors import ConfigError  # noqa: E402

BASE = dict(dtype="float32", cuda_graph_bs=[4], max_running_requests=4, show_progress=False,
            compilation_cache_dir="none", chunked_prefill_size=8, context_length=96)
# Mixed lengths; with chunked prefill 8 the long ones take several chunks, the short one is one token.
PROMPTS = [tm.random_ids(n, seed=200 + n) for n in (5, 19, 1, 12, 9)]
GREEDY = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    d = {k: str(root / k) for k in ("qwen3", "qnext", "eagle", "eagle3", "bigram", "agree_eagle", "bigram_next",
                                    "flat", "agree_flat", "llama", "llama_eagle")}
    tm.build("qwen3", d["qwen3"], seed=41)
    td.write_eagle(d["eagle"], d["qwen3"], seed=1)
    td.write_eagle3(d["eagle3"], d["qwen3"], seed=2, draft_vocab=60)
    tm.build("qwen3_next", d["qnext"], seed=5)
    td.add_mtp(d["qnext"], seed=3)
    tm.build("qwen3", d["bigram"], seed=43)
    td.make_near_bigram(d["bigram"], 0)
    td.write_agreeing_eagle(d["agree_eagle"], d["bigram"], seed=4)
    tm.build("qwen3_next", d["bigram_next"], seed=6)
    td.add_agreeing_mtp(d["bigram_next"], seed=7)
    # Flattened (top token ~0.5 at temperature 1) so that sampling rejects drafts often.
    tm.build("qwen3", d["flat"], seed=43)
    td.make_near_bigram(d["flat"], 0, logit_scale=0.07)
    td.write_agreeing_eagle(d["agree_flat"], d["flat"], seed=4, logit_scale=0.07)
    tm.build("llama", d["llama"], seed=44)
    td.write_eagle(d["llama_eagle"], d["llama"], seed=9, embed=False)
    return d


_refs: dict = {}


def reference(target: str, page_size: int):
    if target not in _refs:
        eng = Engine(target, page_size=page_size, **BASE)
        try:
            _refs[target] = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        finally:
            eng.shutdown()
    return _refs[target]


def spec_engine(models, algo, target, draft, *, steps, topk, ndt, page_size, **kw):
    extra = {} if draft is None else dict(speculative_draft_model_path=models[draft])
    return Engine(models[target], page_size=page_size, speculative_algorithm=algo, speculative_num_steps=steps,
                  speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt, **extra, **{**BASE, **kw})


CASES = [
    # algo, target, draft, steps, topk, draft tokens, page size
    ("EAGLE3", "qwen3", "eagle3", 3, 1, 4, 1),
    ("EAGLE3", "qwen3", "eagle3", 3, 2, 5, 16),
    ("EAGLE", "qwen3", "eagle", 2, 1, 3, 16),
    ("NEXTN", "qnext", None, 2, 3, 6, 1),
]


@pytest.mark.parametrize("algo,target,draft,steps,topk,ndt,page_size", CASES)
def test_random_drafters_give_the_target_greedy_output(models, algo, target, draft, steps, topk, ndt, page_size):
    ref = reference(models[target], 4)
    eng = spec_engine(models, algo, target, draft, steps=steps, topk=topk, ndt=ndt, page_size=page_size)
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == ref
        info = eng.get_server_info()
        assert info["avg_spec_accept_length"] >= 1.0
        assert sum(info["spec_accept_length_histogram"].values()) == sum(o["meta_info"]["spec_verify_ct"]
                                                                         for o in outs)
        leak_free(eng)
    finally:
        eng.shutdown()


SAMPLED = [{"max_new_tokens": 14, "temperature": 0.8, "top_p": 0.9, "seed": 11 + i, "ignore_eos": True}
           for i in range(2)]


@pytest.mark.parametrize("algo,target,draft,topk,ndt,compare_v1", [
    ("EAGLE", "bigram", "agree_eagle", 1, 4, True),
    ("EAGLE", "bigram", "agree_eagle", 2, 6, False),
    ("NEXTN", "bigram_next", None, 1, 4, False),
    ("NEXTN", "bigram_next", None, 2, 6, True),
])
def test_agreeing_drafters_are_accepted_and_exact(models, algo, target, draft, topk, ndt, compare_v1):
    """Drafts that the target mostly keeps: exercises multi-token acceptance, tree walks, the KV
    move of accepted tree nodes, hybrid commits past node 0 and the drafter's catch-up. Runs in
    spec v2 (overlap, the default) with the loop under transfer_guard("disallow"): no
    device-to-host transfer beyond each step's explicit output fetch. Where marked, the
    synchronous loop (v1) must give the same outputs, greedy and seeded sampling alike."""
    ref = reference(models[target], 4)
    sps = [GREEDY] * 3 + SAMPLED
    outs = {}
    for mode in ("v2", "v1") if compare_v1 else ("v2",):
        extra = dict(transfer_guard="disallow") if mode == "v2" else dict(disable_overlap_schedule=True)
        eng = spec_engine(models, algo, target, draft, steps=3, topk=topk, ndt=ndt, page_size=4, **extra)
        try:
            outs[mode] = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=sps)]
            assert eng.get_server_info()["last_error"] is None
            assert eng.get_server_info()["avg_spec_accept_length"] > 2.5
            leak_free(eng)
        finally:
            eng.shutdown()
    assert outs["v2"][:3] == ref[:3]
    if compare_v1:
        assert outs["v1"] == outs["v2"]


def test_llama_target_gets_sglang_defaults_and_exact_trees(models):
    """Unset steps / topk / draft tokens on a Llama target: SGLang's 5 / 4 / 8 (a tree)."""
    ref = reference(models["llama"], 4)
    eng = Engine(models["llama"], page_size=16, speculative_algorithm="EAGLE",
                 speculative_draft_model_path=models["llama_eagle"], **BASE)
    try:
        info = eng.get_server_info()
        assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
                info["speculative_num_draft_tokens"]) == (5, 4, 8)
        assert [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == ref
        leak_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("target,draft", [("bigram", "agree_eagle"), ("bigram_next", None)])
def test_naive_eagle_one_fused_step(models, target, draft):
    """NAIVE_EAGLE: [last, one draft] verified per step, the drafter's format read from its
    config.json (EAGLE here), or the target's MTP layer without a draft path."""
    ref = reference(models[target], 4)
    eng = spec_engine(models, "NAIVE_EAGLE", target, draft, steps=None, topk=None, ndt=None, page_size=4)
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == ref
        info = eng.get_server_info()
        assert info["speculative_num_draft_tokens"] == 2 and 1.5 < info["avg_spec_accept_length"] <= 2.0
        leak_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_sampling_follows_the_target_distribution(models, temperature, top_p):
    """Point-mass drafts tried sibling by sibling against the residual: the second output token
    (always produced by a tree step) must follow the target's own distribution."""
    eng = spec_engine(models, "EAGLE", "flat", "agree_flat", steps=2, topk=2, ndt=4, page_size=4,
                      **{"cuda_graph_bs": [8], "max_running_requests": 8})
    prompt = tm.random_ids(6, seed=78)
    n = 1500
    try:
        sps = [{"max_new_tokens": 2, "temperature": temperature, "top_p": top_p, "seed": i, "ignore_eos": True}
               for i in range(n)]
        outs = eng.generate(input_ids=[prompt] * n, sampling_params=sps)
        leak_free(eng)
    finally:
        eng.shutdown()
    assert eng.get_server_info()["avg_spec_accept_length"] > 1.2  # drafts were kept, and rejected
    second_token_follows_target(outs, prompt, models["flat"], temperature, top_p)


def test_simulated_accept_length(models):
    """Benchmark mode: the mean accept length is forced (outputs then are not the target's)."""
    eng = spec_engine(models, "EAGLE3", "qwen3", "eagle3", steps=3, topk=1, ndt=4, page_size=4,
                      speculative_simulate_accept_length=2.5)
    try:
        eng.generate(input_ids=PROMPTS * 3, sampling_params=dict(GREEDY, max_new_tokens=40))
        info = eng.get_server_info()
        assert info["speculative_simulate_accept_length"] == 2.5
        assert abs(info["avg_spec_accept_length"] - 2.5) < 0.3
        leak_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kw, match", [
    (dict(speculative_algorithm="EAGLE3"), "speculative_draft_model_path is required"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2, speculative_num_draft_tokens=4), "topk"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/nonexistent"), "not a directory"),
    (dict(speculative_algorithm="NAIVE_EAGLE", speculative_num_steps=2), "one token per step"),
    (dict(speculative_algorithm="NAIVE_EAGLE"), "no MTP layer"),
])
def test_bad_settings(models, kw, match):
    with pytest.raises(ConfigError, match=match):
        Engine(models["qwen3"], page_size=4, **{**BASE, **kw})


def test_nextn_needs_mtp_tensors(tmp_path):
    bare = str(tmp_path / "no_mtp")
    tm.build("qwen3_next", bare, seed=8)
    with pytest.raises(Exception, match="mtp"):
        Engine(bare, page_size=4, speculative_algorithm="NEXTN", **BASE)


def test_stress_retraction_aborts_without_recompiling(models):
    """Up to 16 requests per step, a pool small enough to force retraction, random aborts from
    other threads, a tree drafter that keeps most drafts: finished greedy requests still equal
    non-speculative greedy output, nothing leaks, and nothing compiles after start-up."""
    import random
    import threading

    import jax

    rng = random.Random(3)
    prompts = [tm.random_ids(rng.randint(1, 30), seed=500 + i) for i in range(48)]
    lens = [rng.randint(8, 30) for _ in prompts]
    ref_eng = Engine(models["bigram"], page_size=4, **BASE)
    try:
        ref = [o["output_ids"] for o in ref_eng.generate(
            input_ids=prompts, sampling_params=[dict(GREEDY, max_new_tokens=n) for n in lens])]
    finally:
        ref_eng.shutdown()

    eng = spec_engine(models, "EAGLE", "bigram", "agree_eagle", steps=3, topk=2, ndt=6, page_size=4,
                      context_length=64, max_total_tokens=100, cuda_graph_bs=[16], max_running_requests=16)
    compiles = []

    def listener(event, duration, **kw):
        if "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        results, threads = {}, []

        def worker(i):
            results[i] = eng.generate(input_ids=prompts[i], sampling_params=dict(GREEDY, max_new_tokens=lens[i]),
                                      rid=f"r{i}")

        for i in range(len(prompts)):
            th = threading.Thread(target=worker, args=(i,))
            th.start()
            threads.append(th)
            if rng.random() < 0.2:
                eng.abort(f"r{rng.randint(0, i)}")
        for th in threads:
            th.join(120)
        assert len(results) == len(prompts)
        done = [i for i, r in results.items() if r["meta_info"]["finish_reason"]["type"] == "length"]
        assert len(done) > len(prompts) // 2
        for i in done:
            assert results[i]["output_ids"] == ref[i], i
        info = eng.get_server_info()
        assert info["num_retractions"] > 0 and info["last_error"] is None
        assert info["avg_spec_accept_length"] > 2.0
        leak_free(eng)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        eng.shutdown()
    assert compiles == []
