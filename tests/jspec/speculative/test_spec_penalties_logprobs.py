"""Penalties and logprobs under speculation, every drafter family: greedy output with repetition,
frequency and presence penalties equals the plain engine's penalised greedy output (a draft node is
verified against the distribution it would have had its earlier drafts been accepted), and the
reported logprobs and top logprobs of every emitted token equal the plain engine's. Overlapped (v2)
and synchronous (v1) engines alternate across the families; their device steps are the same.
The penalised node distributions themselves: tests/jspec/speculative/test_penalise_nodes.py."""

from __future__ import annotations

import numpy as np
import pytest

from jspec import Engine
from tests.support import models as tm
from tests.support.engines import SPEC_BS4, check_no_leaks, output_ids
from tests.support.spec_eagle import build_models

PS = 4
PROMPTS = [tm.random_ids(7, seed=41) * 2 + tm.random_ids(n, seed=800 + n) for n in (3, 6, 1)]
BASE = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
# One request per setting, in one batch: no penalty, then each penalty alone, then all three.
SAMPLING = [BASE, {**BASE, "repetition_penalty": 3.0}, {**BASE, "frequency_penalty": 2.0},
            {**BASE, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 2.0}]
TOP = 3

# (algorithm, target, drafter, num_steps, topk, num_draft_tokens, overlap)
CASES = {
    "eagle-chain-v1": ("EAGLE", "bigram", "agree_eagle", 3, 1, 4, False),
    "eagle-tree-v2": ("EAGLE", "bigram", "agree_eagle", 3, 2, 5, True),
    "eagle3-v2": ("EAGLE3", "qwen3", "eagle3", 3, 1, 4, True),
    "nextn-hybrid-v2": ("NEXTN", "bigram_next", None, 3, 1, 4, True),
    "standalone-v1": ("STANDALONE", "qwen3", "llama", 2, 1, 3, False),
    "ngram-v2": ("NGRAM", "qwen3", None, 3, 1, 4, True),
    "dflash-v1": ("DFLASH", "block_bigram", "agree_dflash", 3, 1, 4, False),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_checkpoint):
    d = build_models(tmp_path_factory.mktemp("spec_penalties"), ("qwen3", "eagle3", "bigram", "agree_eagle", "block_bigram",
                                                      "agree_dflash", "bigram_next"), tiny_checkpoint)
    d["llama"] = tiny_checkpoint("llama", 42)  # STANDALONE's draft: another architecture, same vocabulary
    return d


def _run(eng):
    outs = eng.generate(input_ids=[p for p in PROMPTS for _ in SAMPLING], sampling_params=SAMPLING * len(PROMPTS),
                        return_logprob=True, top_logprobs_num=TOP)
    return outs


@pytest.fixture(scope="module")
def plain(dirs):
    """The plain engine's outputs per target (same settings, the prefix cache off on both sides)."""
    got = {}

    def get(target):
        if target not in got:
            with Engine(dirs[target], page_size=PS, disable_radix_cache=True, **SPEC_BS4) as eng:
                got[target] = _run(eng)
        return got[target]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_penalised_greedy_and_logprobs_equal_the_plain_engine(dirs, plain, case):
    algo, target, draft, steps, topk, ndt, overlap = CASES[case]
    kw = dict(speculative_algorithm=algo, speculative_num_steps=steps, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=ndt)
    if draft is not None:
        kw["speculative_draft_model_path"] = dirs[draft]
    if algo == "DFLASH":
        kw.pop("speculative_eagle_topk")
        kw.pop("speculative_num_draft_tokens")
    mode = dict(transfer_guard="disallow") if overlap else dict(disable_overlap_schedule=True)
    want = plain(target)
    with Engine(dirs[target], page_size=PS, disable_radix_cache=True, **kw, **mode, **SPEC_BS4) as eng:
        got = _run(eng)
        assert output_ids(got) == output_ids(want)
        # The penalties change what is generated, so the drafts are verified against them.
        ids = output_ids(want)
        assert any(ids[i] != ids[i + k] for i in range(0, len(ids), len(SAMPLING)) for k in range(1, len(SAMPLING)))
        assert sum(o["meta_info"]["spec_verify_ct"] for o in got) < sum(len(o["output_ids"]) for o in got)
        for g, w in zip(got, want):
            gm, wm = g["meta_info"], w["meta_info"]
            assert [t for _, t, _ in gm["output_token_logprobs"]] == g["output_ids"]
            np.testing.assert_allclose([lp for lp, _, _ in gm["output_token_logprobs"]],
                                       [lp for lp, _, _ in wm["output_token_logprobs"]], rtol=1e-4, atol=1e-4)
            assert [[t for _, t, _ in row] for row in gm["output_top_logprobs"]] == \
                [[t for _, t, _ in row] for row in wm["output_top_logprobs"]]
            np.testing.assert_allclose([[lp for lp, _, _ in row] for row in gm["output_top_logprobs"]],
                                       [[lp for lp, _, _ in row] for row in wm["output_top_logprobs"]],
                                       rtol=1e-4, atol=1e-4)
        check_no_leaks(eng)
