"""STANDALONE and NGRAM speculative decoding (chain, greedy): exactness against non-speculative greedy,
full acceptance when the draft is the target, settings validation, no leaks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import tiny_models as tm  # noqa: E402
from spec_checks import DRAWS, leak_free, ngram_reference, second_token_follows_target, two_token_draws  # noqa: E402

from jspec import Engine  # noqa: E402
from jspec.errors import ConfigError, InvalidRequestError  # noqa: E402

BASE = dict(dtype="float32", cuda_graph_bs=[1, 2, 4], max_running_requests=4, show_progress=False,
            compilation_cache_dir="none", chunked_prefill_size=8, context_length=96, disable_top_k_top_p=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("spec_target"))
    draft = str(tmp_path_factory.mktemp("spec_draft"))
    tm.build("qwen3", target, seed=41)
    tm.build("llama", draft, seed=42)  # a different architecture, same vocabulary
    return target, draft


# The last prompt plus 13 new tokens ends exactly at the context length (96): speculative steps
# there write draft positions past it, which the page table must cover.
PROMPTS = [tm.random_ids(n, seed=100 + n) for n in (5, 19, 11, 2, 14, 83)]
GREEDY = {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(dirs):
    eng = Engine(dirs[0], page_size=16, **BASE)
    try:
        return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("page_size,steps", [(1, 3), (16, 2)])
def test_greedy_output_equals_non_speculative(dirs, reference, page_size, steps):
    eng = Engine(dirs[0], page_size=page_size, speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=dirs[1], speculative_num_steps=steps,
                 speculative_num_draft_tokens=steps + 1, **BASE)
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == reference
        for o in outs:
            m = o["meta_info"]
            assert m["spec_verify_ct"] >= 1 and 1.0 <= m["spec_accept_length"] <= steps + 1
            assert m["finish_reason"] == {"type": "length", "length": 13}
        info = eng.get_server_info()
        assert 1.0 <= info["avg_spec_accept_length"] <= steps + 1
        assert set(info["spec_accept_length_histogram"]) <= set(range(1, steps + 2))
        leak_free(eng)
    finally:
        eng.shutdown()


def test_draft_equal_to_target_accepts_everything(dirs, reference):
    steps = 3
    eng = Engine(dirs[0], page_size=4, speculative_algorithm="STANDALONE", speculative_draft_model_path=dirs[0],
                 speculative_num_steps=steps, **BASE)
    try:
        # 1 token from prefill + 3 verify steps of 4 tokens each.
        sp = dict(GREEDY, max_new_tokens=1 + 3 * (steps + 1))
        outs = eng.generate(input_ids=PROMPTS[:3], sampling_params=sp)
        for o, ref in zip(outs, reference):
            assert o["meta_info"]["spec_verify_ct"] == 3
            assert o["output_ids"][:13] == ref
        assert eng.get_server_info()["spec_accept_length_histogram"] == {steps + 1: 9}
        assert eng.get_server_info()["avg_spec_accept_length"] == steps + 1
        leak_free(eng)
    finally:
        eng.shutdown()


def test_stop_token_inside_an_accepted_run_truncates(dirs, reference):
    eng = Engine(dirs[0], page_size=4, speculative_algorithm="STANDALONE", speculative_draft_model_path=dirs[0],
                 **BASE)
    try:
        ref = reference[1]
        stop = ref[6]
        out = eng.generate(input_ids=PROMPTS[1], sampling_params=dict(GREEDY, stop_token_ids=[stop],
                                                                        ignore_eos=False))
        assert out["output_ids"] == ref[: ref.index(stop) + 1]
        leak_free(eng)
    finally:
        eng.shutdown()


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
def test_bad_settings(dirs, kw, match):
    with pytest.raises(ConfigError, match=match):
        Engine(dirs[0], **{**BASE, **kw})


def test_draft_vocabulary_must_match(dirs, tmp_path):
    other = str(tmp_path / "other_vocab")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(other)
    with pytest.raises(ConfigError, match="vocabulary"):
        Engine(dirs[0], speculative_algorithm="STANDALONE", speculative_draft_model_path=other, **BASE)


def test_penalties_rejected_clearly(dirs):
    eng = Engine(dirs[0], page_size=4, speculative_algorithm="STANDALONE", speculative_draft_model_path=dirs[1],
                 **BASE)
    try:
        with pytest.raises(InvalidRequestError, match="frequency_penalty"):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"frequency_penalty": 0.5, "max_new_tokens": 4})
        # BASE starts engines with disable_top_k_top_p: no sort variants were compiled, and a
        # request that needs them is refused by name.
        assert all(not b.sort for b in eng.runner.buckets)
        with pytest.raises(InvalidRequestError, match="top_p.*disable_top_k_top_p"):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"temperature": 1.0, "top_p": 0.5})
        with pytest.raises(InvalidRequestError, match="top_k"):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"temperature": 1.0, "top_k": 5})
        ok = eng.generate(input_ids=[1, 2, 3], sampling_params={"temperature": 0, "max_new_tokens": 4})
        assert len(ok["output_ids"]) == 4
    finally:
        eng.shutdown()


@pytest.mark.parametrize("algo,temperature,top_p", [("STANDALONE", 1.0, 1.0), ("STANDALONE", 0.7, 0.9),
                                                    ("NGRAM", 1.0, 1.0)])
def test_speculative_sampling_follows_the_target_distribution(dirs, algo, temperature, top_p):
    """The second output token always comes out of a speculative step (accepted draft or residual
    draw). Given the first token, its law must be the target's own, not the drafter's: chi-square
    of its counts against transformers' distribution for each observed first token."""
    target, draft = dirs
    kw = dict(speculative_draft_model_path=draft) if algo == "STANDALONE" else {}
    eng = Engine(target, page_size=4, speculative_algorithm=algo, speculative_num_steps=2,
                 **{**BASE, **DRAWS, "disable_top_k_top_p": top_p == 1.0}, **kw)
    prompt = tm.random_ids(6, seed=77)
    try:
        outs = two_token_draws(eng, prompt, 1500, temperature, top_p)
    finally:
        eng.shutdown()
    second_token_follows_target(outs, prompt, target, temperature, top_p)


# ------------------------------------------------------------------------------------------- NGRAM
def test_ngram_reference_proposes_the_latest_continuation():
    ids = [5, 6, 7, 8, 1, 2, 6, 7, 9, 4, 6, 7]
    # Suffix [6, 7] last occurred ending at index 7 (followed by 9, 4); longest window first:
    # [4, 6, 7] never occurred, [6, 7] did.
    assert ngram_reference(ids, 3, 1, 3) == [9, 4, 6]
    assert ngram_reference(ids + [9], 2, 1, 3) == [4, 6]  # [7, 9] ends at 8, followed by 4, 6
    assert ngram_reference([1, 2, 3], 2, 2, 3) == [3, 3]  # no match: the newest token
    assert ngram_reference([4, 1, 2, 4], 3, 1, 2) == [1, 2, 4]  # cut at the newest token


@pytest.mark.parametrize("min_w,max_w,steps", [(1, 4, 3), (2, 3, 5), (1, 1, 2), (3, 12, 4)])
def test_device_ngram_matches_reference(min_w, max_w, steps):
    """The device matcher on a batch of histories (small alphabets, so windows recur; stale
    tokens past each request's newest one, which must not be matched or drafted)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.spec import ngram

    rng = np.random.default_rng(min_w * 100 + max_w)
    h, rows, lasts, want = 40, [], [], []
    for i in range(48):
        n = int(rng.integers(1, h + 1))
        ids = rng.integers(0, 2 + i % 5, n).tolist()
        rows.append(ids + rng.integers(0, 7, h - n).tolist())
        lasts.append(n - 1)
        want.append(ngram_reference(ids, steps, min_w, max_w))
    got = jax.jit(ngram.propose, static_argnums=(2, 3, 4))(jnp.asarray(rows, jnp.int32), jnp.asarray(lasts),
                                                              steps, min_w, max_w)
    assert np.asarray(got).tolist() == want


@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
def test_ngram_exact_and_accepts_on_repetitive_text(dirs, reference, overlap):
    """Greedy NGRAM equals greedy decoding, synchronous (v1) and overlapped (v2, the loop under
    transfer_guard("disallow"): the drafts come from the device, nothing is read back early)."""
    extra = dict(transfer_guard="disallow") if overlap else dict(disable_overlap_schedule=True)
    eng = Engine(dirs[0], page_size=4, speculative_algorithm="NGRAM", speculative_num_steps=4,
                 speculative_ngram_max_match_window_size=4, **BASE, **extra)
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == reference
        pattern = tm.random_ids(6, seed=9)
        rep = eng.generate(input_ids=pattern * 5, sampling_params=dict(GREEDY, max_new_tokens=40))
        assert rep["meta_info"]["spec_accept_length"] > 2, rep["meta_info"]
        assert eng.get_server_info()["last_error"] is None
        leak_free(eng)
    finally:
        eng.shutdown()


def test_ngram_rejects_a_draft_model(dirs):
    with pytest.raises(ConfigError, match="NGRAM"):
        Engine(dirs[0], speculative_algorithm="NGRAM", speculative_draft_model_path=dirs[1], **BASE)
