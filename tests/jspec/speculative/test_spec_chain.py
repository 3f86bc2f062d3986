"""STANDALONE speculative decoding (chain, greedy): exactness against non-speculative greedy, full
acceptance when the draft is the target, stop tokens inside accepted runs, settings and request
validation, no leaks. NGRAM and the sampling-distribution tests of both chain drafters:
test_spec_ngram.py (a second file, so that `-n 2 --dist loadfile` runs the two side by side)."""

from __future__ import annotations

import pytest

from jspec import Engine
from jspec.errors import ConfigError, InvalidRequestError
from tests.support.engines import check_no_leaks, generates
from tests.support.spec_chain import BASE, GREEDY, PROMPTS


@pytest.mark.parametrize("page_size,steps", [(1, 3), (16, 2)])
def test_greedy_output_equals_non_speculative(chain_dirs, chain_reference, page_size, steps):
    eng = Engine(chain_dirs[0], page_size=page_size, speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=chain_dirs[1], speculative_num_steps=steps,
                 speculative_num_draft_tokens=steps + 1, **BASE)
    try:
        outs = generates(eng, PROMPTS, GREEDY, chain_reference)
        for o in outs:
            m = o["meta_info"]
            assert m["spec_verify_ct"] >= 1 and 1.0 <= m["spec_accept_length"] <= steps + 1
            assert m["finish_reason"] == {"type": "length", "length": 13}
        info = eng.get_server_info()
        assert 1.0 <= info["avg_spec_accept_length"] <= steps + 1
        assert set(info["spec_accept_length_histogram"]) <= set(range(1, steps + 2))
        check_no_leaks(eng)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def self_draft(chain_dirs):
    """STANDALONE with the target as its own draft, SGLang's default chain (3 steps, 4 draft
    tokens, which the first test below checks), shared by the tests that use it (one compile).
    One decode batch size (CI time): fewer requests run padded into it; the engine's batch-1 and
    batch-2 STANDALONE steps are compiled and checked by test_greedy_output_equals_non_speculative,
    whose last requests run alone."""
    eng = Engine(chain_dirs[0], page_size=4, speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=chain_dirs[0], **{**BASE, "cuda_graph_bs": [4]})
    yield eng
    eng.shutdown()


def _histogram(eng) -> dict:
    return dict(eng.get_server_info()["spec_accept_length_histogram"])


def test_draft_equal_to_target_accepts_everything(self_draft, chain_reference):
    eng, steps = self_draft, 3
    info = eng.get_server_info()
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == (steps, 1, steps + 1)
    before = _histogram(eng)  # the engine is shared: count this test's verify steps only
    # 1 token from prefill + 3 verify steps of 4 tokens each.
    sp = dict(GREEDY, max_new_tokens=1 + 3 * (steps + 1))
    outs = eng.generate(input_ids=PROMPTS[:3], sampling_params=sp)
    for o, ref in zip(outs, chain_reference):
        assert o["meta_info"]["spec_verify_ct"] == 3
        assert o["output_ids"][:13] == ref
    after = _histogram(eng)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert delta == {steps + 1: 9}  # every verify step kept all its drafts
    check_no_leaks(eng)


def test_stop_token_inside_an_accepted_run_truncates(self_draft, chain_reference):
    eng = self_draft
    ref = chain_reference[1]
    stop = ref[6]
    out = eng.generate(input_ids=PROMPTS[1], sampling_params=dict(GREEDY, stop_token_ids=[stop],
                                                                    ignore_eos=False))
    assert out["output_ids"] == ref[: ref.index(stop) + 1]
    check_no_leaks(eng)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_num_draft_tokens=6),
         "speculative_num_draft_tokens"),
        (dict(speculative_algorithm="STANDALONE", speculative_num_steps=2, speculative_eagle_topk=2,
              speculative_num_draft_tokens=6), "speculative_num_draft_tokens"),
        (dict(speculative_algorithm="DFLASH"), "speculative_draft_model_path"),
        (dict(speculative_algorithm="DFLASH", speculative_eagle_topk=2, speculative_draft_model_path="x"),
         "DFLASH drafts one block"),
        (dict(speculative_algorithm="NEXTN"), "no MTP layer"),
        (dict(speculative_algorithm="STANDALONE", speculative_simulate_accept_length=9.0), "simulate_accept_length"),
        (dict(speculative_algorithm="WHATEVER"), "speculative_algorithm"),
        (dict(speculative_algorithm="STANDALONE"), "speculative_draft_model_path"),
        (dict(speculative_num_steps=3), "speculative_algorithm"),
    ],
)
def test_bad_settings(chain_dirs, kw, match):
    with pytest.raises(ConfigError, match=match):
        Engine(chain_dirs[0], **{**BASE, **kw})


def test_draft_vocabulary_must_match(chain_dirs, tmp_path):
    other = str(tmp_path / "other_vocab")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(other)
    with pytest.raises(ConfigError, match="vocabulary"):
        Engine(chain_dirs[0], speculative_algorithm="STANDALONE", speculative_draft_model_path=other, **BASE)


def test_uncompiled_sampler_variants_rejected_clearly(self_draft):
    """Request validation of a speculative engine (it does not depend on which draft model the
    engine holds; the shared self-drafting one serves)."""
    eng = self_draft
    # BASE starts engines with disable_top_k_top_p: no sort variants were compiled, and a
    # request that needs them is refused by name.
    assert all(not b.sort for b in eng.runner.buckets)
    with pytest.raises(InvalidRequestError, match="top_p.*disable_top_k_top_p"):
        eng.generate(input_ids=[1, 2, 3], sampling_params={"temperature": 1.0, "top_p": 0.5})
    with pytest.raises(InvalidRequestError, match="top_k"):
        eng.generate(input_ids=[1, 2, 3], sampling_params={"temperature": 1.0, "top_k": 5})
    ok = eng.generate(input_ids=[1, 2, 3], sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert len(ok["output_ids"]) == 4
    check_no_leaks(eng)
