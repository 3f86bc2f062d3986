"""EAGLE-family drafters that agree with their (near-bigram) targets, so most drafts are kept:
multi-token acceptance, tree walks, KV moves, hybrid commits past node 0 and the drafter's catch-up,
in spec v2 under the transfer guard and against spec v1; exact sampling through a tree; a stress run
with retraction and aborts."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import tiny_models as tm  # noqa: E402
from compile_checks import compilations  # noqa: E402
from spec_checks import DRAWS, leak_free, second_token_follows_target, two_token_draws  # noqa: E402
from spec_eagle_common import BASE, GREEDY, PROMPTS, build_models, reference, spec_engine  # noqa: E402

from jspec import Engine  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("agree"), ("bigram", "agree_eagle", "bigram_next", "flat",
                                                           "agree_flat"))


# Plain temperature (top-k / top-p through a tree: test_tree_sampling_follows_the_target_distribution).
SAMPLED = [{"max_new_tokens": 14, "temperature": 0.8, "seed": 11 + i, "ignore_eos": True} for i in range(2)]


@pytest.mark.parametrize("algo,target,draft,topk,ndt,compare_v1", [
    ("EAGLE", "bigram", "agree_eagle", 1, 4, True),
    ("EAGLE", "bigram", "agree_eagle", 2, 6, False),
    ("NEXTN", "bigram_next", None, 1, 4, True),
    ("NEXTN", "bigram_next", None, 2, 6, False),
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
            res = eng.generate(input_ids=PROMPTS, sampling_params=sps)
            outs[mode] = [o["output_ids"] for o in res]
            assert eng.get_server_info()["last_error"] is None
            # Greedy rows keep most drafts (sampled ones, at temperature 0.8, fewer).
            greedy_accept = [o["meta_info"]["spec_accept_length"] for o in res[:3]]
            assert min(greedy_accept) > 2.5, greedy_accept
            leak_free(eng)
        finally:
            eng.shutdown()
    assert outs["v2"][:3] == ref[:3]
    if compare_v1:
        assert outs["v1"] == outs["v2"]


# Temperature 1 without top-p: test_tree_accept.py (the walk alone) and the chain tests.
@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9)])
def test_tree_sampling_follows_the_target_distribution(models, temperature, top_p):
    """Point-mass drafts tried sibling by sibling against the residual: the second output token
    (always produced by a tree step) must follow the target's own distribution."""
    eng = spec_engine(models, "EAGLE", "flat", "agree_flat", steps=2, topk=2, ndt=4, page_size=4,
                      **DRAWS, disable_top_k_top_p=False)
    prompt = tm.random_ids(6, seed=78)
    try:
        outs = two_token_draws(eng, prompt, 1500, temperature, top_p)
    finally:
        eng.shutdown()
    assert eng.get_server_info()["avg_spec_accept_length"] > 1.2  # drafts were kept, and rejected
    second_token_follows_target(outs, prompt, models["flat"], temperature, top_p)


def test_stress_retraction_aborts_without_recompiling(models):
    """Up to 16 requests per step, a pool small enough to force retraction, random aborts from
    other threads, a tree drafter that keeps most drafts: finished greedy requests still equal
    non-speculative greedy output, nothing leaks, and nothing compiles after start-up."""
    import random
    import threading

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
    try:
        with compilations() as compiles:
            results, threads = {}, []

            def worker(i):
                results[i] = eng.generate(input_ids=prompts[i],
                                          sampling_params=dict(GREEDY, max_new_tokens=lens[i]), rid=f"r{i}")

            for i in range(len(prompts)):
                th = threading.Thread(target=worker, args=(i,))
                th.start()
                threads.append(th)
                if rng.random() < 0.2:
                    eng.abort(f"r{rng.randint(0, i)}")
            for th in threads:
                th.join(120)
        assert compiles == []
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
        eng.shutdown()
