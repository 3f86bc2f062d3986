"""EAGLE drafters that agree with their dense (near-bigram) target, so most drafts are kept:
multi-token acceptance, tree walks, KV moves and the drafter's catch-up, in spec v2 under the
transfer guard and against spec v1; NAIVE_EAGLE with an EAGLE drafter; exact sampling through a
tree; a stress run with retraction and aborts. The hybrid target (NEXTN, NAIVE_EAGLE with MTP,
NGRAM): test_spec_eagle_hybrid.py."""

from __future__ import annotations

import pytest

from jspec import Engine
from tests.support import models as tm
from tests.support.compiles import compilations
from tests.support.engines import check_no_leaks, output_ids
from tests.support.spec import DRAWS, second_token_follows_target, two_token_draws
from tests.support.spec_eagle import (BASE, GREEDY, build_models, check_agreeing_drafter, check_naive_eagle,
                                      reference, spec_engine)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    return build_models(tmp_path_factory.mktemp("agree"), ("bigram", "agree_eagle", "flat", "agree_flat"),
                        tiny_checkpoint)


@pytest.fixture(scope="module")
def plain_bigram(models, greedy_reference):
    """The non-speculative engine of the bigram target: it serves the reference outputs of
    PROMPTS and of the stress run's prompts (one compile for both)."""
    eng = Engine(models["bigram"], page_size=4, **BASE)
    reference(greedy_reference, models["bigram"], engine=eng)
    yield eng
    eng.shutdown()


# The hybrid target's MTP layer, chain and tree: test_spec_eagle_hybrid.py.
@pytest.mark.parametrize("algo,target,draft,topk,ndt,compare_v1", [
    ("EAGLE", "bigram", "agree_eagle", 1, 4, True),
    ("EAGLE", "bigram", "agree_eagle", 2, 6, False),
])
def test_agreeing_drafters_are_accepted_and_exact(models, greedy_reference, plain_bigram, algo, target, draft, topk,
                                                  ndt, compare_v1):
    ref = reference(greedy_reference, models[target], engine=plain_bigram)
    check_agreeing_drafter(models, algo, target, draft, topk, ndt, compare_v1, ref)


def test_naive_eagle_one_fused_step(models, greedy_reference, plain_bigram):
    """NAIVE_EAGLE with an EAGLE drafter (its format read from its config.json); with the hybrid
    target's MTP layer: test_spec_eagle_hybrid.py."""
    check_naive_eagle(models, "bigram", "agree_eagle", reference(greedy_reference, models["bigram"],
                                                                 engine=plain_bigram))


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


def test_stress_retraction_aborts_without_recompiling(models, plain_bigram):
    """Up to 16 requests per step, a pool small enough to force retraction, random aborts from
    other threads, a tree drafter that keeps most drafts: finished greedy requests still equal
    non-speculative greedy output, nothing leaks, and nothing compiles after start-up."""
    import random
    import threading

    rng = random.Random(3)
    prompts = [tm.random_ids(rng.randint(1, 30), seed=500 + i) for i in range(48)]
    lens = [rng.randint(8, 30) for _ in prompts]
    ref = output_ids(plain_bigram.generate(input_ids=prompts,
                                           sampling_params=[dict(GREEDY, max_new_tokens=n) for n in lens]))

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
        check_no_leaks(eng)
    finally:
        eng.shutdown()
