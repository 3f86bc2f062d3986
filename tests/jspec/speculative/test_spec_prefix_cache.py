"""The prefix cache under speculation: greedy output with cached prefixes equals non-speculative
greedy output, for every drafter family and a hybrid target (NEXTN, GDN state snapshots),
overlapped (v2) and synchronous (v1); a
cache hit keeps the drafter's context, so a repeated prompt is verified in exactly as many steps as
its first run (the same drafts), even after other requests overwrote every slot; EAGLE-family
engines key the cache by token pairs, so a page whose next token differs is not reused."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import models as tm
from tests.support.engines import SPEC_BS4, check_no_leaks, generates
from tests.support.spec_eagle import build_models, case_kwargs

from jspec import Engine

PS = 4
SYSTEM = tm.random_ids(7, seed=31) * 3  # 21 tokens, repetitive (NGRAM finds matches in it)
PROMPTS = [SYSTEM + tm.random_ids(n, seed=600 + n) for n in (3, 6, 1, 9)]
OTHERS = [tm.random_ids(n, seed=700 + n) for n in (30, 25, 28, 22)]  # every slot, other tokens
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
TRACK = 8  # hybrid engines keep the GDN state at every multiple of 8 tokens during decode


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_checkpoint):
    d = build_models(tmp_path_factory.mktemp("spec_cache"), ("qwen3", "eagle3", "bigram", "agree_eagle", "block_bigram",
                                                      "agree_dflash", "bigram_next"), tiny_checkpoint)
    d["llama"] = tiny_checkpoint("llama", 42)  # STANDALONE's draft: another architecture, same vocabulary
    return d


# (algorithm, target, drafter, num_steps, topk, num_draft_tokens, overlap). The EAGLE, NGRAM and
# DFLASH cases accept several drafts per step (agreeing drafters, a repetitive prompt), so a drafter
# context lost on a cache hit would change their verify counts.
CASES = {
    "eagle3-v2": ("EAGLE3", "qwen3", "eagle3", 3, 1, 4, True),
    "eagle3-v1": ("EAGLE3", "qwen3", "eagle3", 3, 1, 4, False),
    "eagle-tree-v2": ("EAGLE", "bigram", "agree_eagle", 3, 2, 5, True),
    "eagle-chain-v1": ("EAGLE", "bigram", "agree_eagle", 3, 1, 4, False),
    "standalone-v2": ("STANDALONE", "qwen3", "llama", 2, 1, 3, True),
    "ngram-v1": ("NGRAM", "qwen3", None, 3, 1, 4, False),
    "dflash-v2": ("DFLASH", "block_bigram", "agree_dflash", 3, 1, 4, True),
    # Hybrid (Gated-DeltaNet) target: GDN state snapshots beside the pages.
    "nextn-hybrid-v2": ("NEXTN", "bigram_next", None, 3, 1, 4, True),
    "nextn-hybrid-v1": ("NEXTN", "bigram_next", None, 3, 1, 4, False),
    "nextn-hybrid-tree-v2": ("NEXTN", "bigram_next", None, 3, 2, 5, True),
}


@pytest.fixture(scope="module")
def engines(dirs):
    """One engine per case, built when first asked for, shared by the tests of this file."""
    built = {}

    def get(case):
        if case not in built:
            built[case] = _engine(dirs, case)
        return built[case]

    yield get
    for eng in built.values():
        eng.shutdown()


def _engine(dirs, case):
    target = CASES[case][1]
    mode = case_kwargs(dirs, CASES[case])
    if target == "bigram_next":  # room for every snapshot these tests take (LRU: test_prefix_cache.py)
        mode.update(max_mamba_cache_size=64, mamba_track_interval=TRACK)
    # A pool that keeps every prefix cached here (eviction: tests/jspec/runtime/test_prefix_cache.py).
    return Engine(dirs[target], page_size=PS, max_total_tokens=1024, **mode, **SPEC_BS4)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_cached_prefixes_is_exact_and_keeps_the_drafts(dirs, engines, greedy_reference, case):
    target = dirs[CASES[case][1]]
    want = greedy_reference(target, PROMPTS, GREEDY, page_size=PS, settings=SPEC_BS4)
    eng = engines(case)
    assert eng.get_server_info()["radix_cache"] is True
    first = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert first["output_ids"] == want[0] and first["meta_info"]["cached_tokens"] == 0
    generates(eng, OTHERS, GREEDY, greedy_reference(target, OTHERS, GREEDY, page_size=PS, settings=SPEC_BS4))
    again = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    m = again["meta_info"]
    assert again["output_ids"] == want[0]
    # Its prompt and what it generated were cached at its finish: all but the last prompt token; on
    # the hybrid target up to the deepest GDN snapshot, taken where its prompt chunks (8) ended.
    hybrid = CASES[case][1] == "bigram_next"
    assert m["cached_tokens"] == (16 if hybrid else (len(PROMPTS[0]) - 1) // PS * PS), m["cached_tokens"]
    assert m["spec_verify_ct"] == first["meta_info"]["spec_verify_ct"], (m, first["meta_info"])
    outs = generates(eng, PROMPTS, GREEDY, want)
    assert all(o["meta_info"]["cached_tokens"] >= 16 for o in outs), [o["meta_info"]["cached_tokens"] for o in outs]
    assert eng.get_server_info()["last_error"] is None
    check_no_leaks(eng)  # the cache is empty after it
    # A repetition penalty counts prompt tokens: reusing the cached prompt gives the uncached output.
    rep = {**GREEDY, "repetition_penalty": 1.8}
    uncached = eng.generate(input_ids=PROMPTS[1], sampling_params=rep)
    cached = eng.generate(input_ids=PROMPTS[1], sampling_params=rep)
    assert uncached["meta_info"]["cached_tokens"] == 0 and cached["meta_info"]["cached_tokens"] >= 16
    assert cached["output_ids"] == uncached["output_ids"]
    if CASES[case][1] == "qwen3":  # the bigram targets repeat one token whatever the prompt holds
        assert cached["output_ids"] != want[1]  # the penalty changed this output
    check_no_leaks(eng)


def test_eagle_keys_need_the_next_token_too(engines):
    """The system prompt's last full page (tokens 16..19) is followed by token 20 in every prompt, so
    both keys match it; a prompt whose token 20 differs reuses one page less with EAGLE3 (its
    draft KV at 19 was computed from token 20) and every page with STANDALONE."""
    other = SYSTEM[:20] + [(SYSTEM[20] + 1) % tm.VOCAB] + PROMPTS[0][21:]
    for case, want in (("eagle3-v2", 16), ("standalone-v2", 20)):
        eng = engines(case)
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        out = eng.generate(input_ids=other, sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] == want, (case, out["meta_info"]["cached_tokens"])
        check_no_leaks(eng)


def _snapshot(eng, ids, length):
    """The GDN state (conv windows, recurrent states of every layer) the cache holds for ids[:length]."""
    node = eng.radix_cache.path_end(ids, length)
    assert node.depth * PS == length and node.state is not None, f"no snapshot at {length}"
    caches = eng.runner.state.caches
    return [np.asarray(c[node.state]) for c in (*caches.conv, *caches.ssm)]


@pytest.mark.parametrize("case", ["nextn-hybrid-v2", "nextn-hybrid-v1", "nextn-hybrid-tree-v2"])
def test_hybrid_decode_state_follows_the_accepted_tokens(engines, case):
    """Speculative steps accept up to 4 tokens at a time, so the length passes 32 inside a step's
    accepted run: the commit keeps the state at exactly 32 tokens (never a rejected draft's), equal
    to the snapshot a prefill of those 32 tokens leaves; and the next turn of the chat (prompt 24 +
    reply 12 + a question) reuses 32 tokens, the reply's first 8 included, and answers as it does
    from scratch."""
    eng = engines(case)
    assert eng.flush_cache()
    first = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert first["meta_info"]["spec_verify_ct"] < 8  # several tokens per step, so 32 falls inside a run
    ids = PROMPTS[0] + first["output_ids"]
    tracked = _snapshot(eng, ids, 32)
    follow = ids + tm.random_ids(5, seed=902)
    cached = eng.generate(input_ids=follow, sampling_params=GREEDY)
    assert cached["meta_info"]["cached_tokens"] == 32, cached["meta_info"]
    assert eng.flush_cache()
    fresh = eng.generate(input_ids=follow, sampling_params=GREEDY)
    assert fresh["meta_info"]["cached_tokens"] == 0 and fresh["output_ids"] == cached["output_ids"]
    assert eng.flush_cache()
    eng.generate(input_ids=ids[:33], sampling_params={**GREEDY, "max_new_tokens": 1})  # chunks end at 32
    for i, (got, want) in enumerate(zip(tracked, _snapshot(eng, ids, 32))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"state array {i}")
    check_no_leaks(eng)
