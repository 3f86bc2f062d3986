"""EAGLE and EAGLE3 on dense targets: greedy output equal to non-speculative greedy output with
random drafters in their published formats (which almost never agree), chain and tree, on Qwen3 and
Llama targets; SGLang's defaults; simulated acceptance; settings errors; no leaks. Agreeing drafters
(and NAIVE_EAGLE), sampling and stress on a dense target: test_spec_eagle_agree.py; the hybrid
Qwen3-Next target (NEXTN, NAIVE_EAGLE with MTP, NGRAM): test_spec_eagle_hybrid.py."""

from __future__ import annotations

import pytest

from jspec import Engine
from jspec.errors import ConfigError
from tests.support.engines import check_no_leaks, generates
from tests.support.spec_eagle import BASE, GREEDY, PROMPTS, build_models, reference, spec_engine


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    return build_models(tmp_path_factory.mktemp("eagle"), ("qwen3", "eagle", "eagle3", "llama", "llama_eagle"),
                        tiny_checkpoint)


CASES = [
    # algo, target, draft, steps, topk, draft tokens, page size
    ("EAGLE3", "qwen3", "eagle3", 3, 1, 4, 1),
    ("EAGLE3", "qwen3", "eagle3", 3, 2, 5, 16),
    ("EAGLE", "qwen3", "eagle", 2, 1, 3, 16),
    # Hybrid (Qwen3-Next) targets with their MTP layer, chain and tree, run in
    # test_spec_eagle_hybrid.py (drafts kept and rejected), with NAIVE_EAGLE.
]


@pytest.mark.parametrize("algo,target,draft,steps,topk,ndt,page_size", CASES)
def test_random_drafters_give_the_target_greedy_output(models, greedy_reference, algo, target, draft, steps, topk,
                                                        ndt, page_size):
    ref = reference(greedy_reference, models[target])
    eng = spec_engine(models, algo, target, draft, steps=steps, topk=topk, ndt=ndt, page_size=page_size)
    try:
        outs = generates(eng, PROMPTS, GREEDY, ref)
        info = eng.get_server_info()
        assert info["avg_spec_accept_length"] >= 1.0
        assert sum(info["spec_accept_length_histogram"].values()) == sum(o["meta_info"]["spec_verify_ct"]
                                                                         for o in outs)
        check_no_leaks(eng)
    finally:
        eng.shutdown()


def test_llama_target_gets_sglang_defaults_and_exact_trees(models, greedy_reference):
    """Unset steps / topk / draft tokens on a Llama target: SGLang's 5 / 4 / 8 (a tree)."""
    ref = reference(greedy_reference, models["llama"])
    eng = Engine(models["llama"], page_size=16, speculative_algorithm="EAGLE",
                 speculative_draft_model_path=models["llama_eagle"], **BASE)
    try:
        info = eng.get_server_info()
        assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
                info["speculative_num_draft_tokens"]) == (5, 4, 8)
        generates(eng, PROMPTS, GREEDY, ref)
        check_no_leaks(eng)
    finally:
        eng.shutdown()


def test_simulated_accept_length(models):
    """Benchmark mode: the mean accept length is forced (outputs then are not the target's)."""
    eng = spec_engine(models, "EAGLE3", "qwen3", "eagle3", steps=3, topk=1, ndt=4, page_size=4,
                      speculative_simulate_accept_length=2.5)
    try:
        eng.generate(input_ids=PROMPTS * 3, sampling_params=dict(GREEDY, max_new_tokens=40))
        info = eng.get_server_info()
        assert info["speculative_simulate_accept_length"] == 2.5
        assert abs(info["avg_spec_accept_length"] - 2.5) < 0.3
        check_no_leaks(eng)
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
