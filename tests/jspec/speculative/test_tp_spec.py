"""Every speculative algorithm on a target split over 2 or 4 devices (the drafter replicated):
greedy output equals the unsplit target's alone, chain and tree, spec v1 and v2, including
drafters the target mostly agrees with (multi-token acceptance, KV moves of accepted tree nodes,
GDN commits past node 0 on split state pools), with no step gathering vocabulary rows, and a logit
bias honoured on the split vocabulary. The
session has 4 CPU devices (tests/conftest.py); split layouts themselves: tests/jspec/test_sharding.py."""

from __future__ import annotations

import pytest

from jspec import Engine
from jspec.runtime import startup_runs
from tests.support import drafters as td
from tests.support import models as tm
from tests.support.engines import check_no_leaks, generates
from tests.support.spec_eagle import BASE, GREEDY, PROMPTS, build_models, reference


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("tp_spec")
    d = build_models(root, ("qwen3", "llama", "eagle3", "llama_eagle", "bigram", "agree_eagle", "bigram_next"),
                     tiny_checkpoint)
    d["draft"] = tiny_checkpoint("llama", 42)  # STANDALONE: another architecture, same vocabulary
    d["block_bigram"], d["agree_dflash"] = str(root / "block_bigram"), str(root / "agree_dflash")
    tm.build("qwen3", d["block_bigram"], seed=42)
    td.make_block_bigram(d["block_bigram"])
    td.write_agreeing_dflash(d["agree_dflash"], d["block_bigram"], block_size=4)
    return d


CASES = [
    # algorithm, target, draft, tp, steps, topk, draft tokens, overlap
    ("EAGLE", "llama", "llama_eagle", 4, 3, 2, 6, True),  # tree; 2 KV heads replicated 4 ways
    ("EAGLE", "bigram", "agree_eagle", 2, 3, 1, 4, False),  # agreeing head, spec v1
    ("EAGLE3", "qwen3", "eagle3", 2, 3, 1, 4, True),  # reduced draft vocabulary (60 of 97)
    ("NEXTN", "bigram_next", None, 2, 3, 1, 4, True),  # agreeing MTP layer, GDN pools split, v2
    ("NEXTN", "bigram_next", None, 2, 3, 2, 6, False),  # tree, v1
    ("DFLASH", "block_bigram", "agree_dflash", 2, None, None, 4, True),
    ("STANDALONE", "qwen3", "draft", 4, 3, 1, 4, True),
]


@pytest.mark.parametrize("algo,target,draft,tp,steps,topk,ndt,overlap", CASES)
def test_speculation_on_a_split_target_equals_target_greedy(models, greedy_reference, algo, target, draft, tp,
                                                            steps, topk, ndt, overlap, monkeypatch):
    want = reference(greedy_reference, models[target])
    warmed, warm = [], startup_runs.warm_up
    if (algo, overlap) == ("NEXTN", True):  # the GPU's start-up warm-up over split GDN pools: answers unchanged
        monkeypatch.setenv("JSPEC_WARM_UP", "1")
        monkeypatch.setattr(startup_runs, "warm_up", lambda runner: warmed.append(warm(runner)) or warmed[-1])
    kw = dict(speculative_algorithm=algo, speculative_num_draft_tokens=ndt)
    if draft is not None:
        kw["speculative_draft_model_path"] = models[draft]
    if steps is not None:
        kw.update(speculative_num_steps=steps, speculative_eagle_topk=topk)
    kw.update(dict(transfer_guard="disallow") if overlap else dict(disable_overlap_schedule=True))
    eng = Engine(models[target], page_size=4, tp_size=tp, **kw, **BASE)
    try:
        assert warmed == ([len(eng.runner.buckets)] if (algo, overlap) == ("NEXTN", True) else [])
        generates(eng, PROMPTS, GREEDY, want)
        # A logit bias on a split vocabulary (each device adds the entries in its slice): the free
        # output's tokens banned, or the last shard's token 90 forced.
        seen = sorted({t for w in want for t in w})
        biased = eng.generate(input_ids=PROMPTS[:2], sampling_params=[
            {**GREEDY, "logit_bias": {str(t): -100 for t in seen}}, {**GREEDY, "logit_bias": {"90": 100}}])
        assert not set(biased[0]["output_ids"]) & set(seen)
        assert biased[1]["output_ids"] == [90] * GREEDY["max_new_tokens"]
        info = eng.get_server_info()
        assert info["tp_size"] == tp and info["last_error"] is None
        if target in ("bigram", "bigram_next", "block_bigram"):  # agreeing drafters: drafts are kept
            assert max(info["spec_accept_length_histogram"]) >= 3, info["spec_accept_length_histogram"]
        check_no_leaks(eng)
        # No step moves whole vocabulary rows, in decode or prompt steps: drafts ranked over a
        # split target's lm_head and the acceptance's reductions exchange candidates only
        # (ops.vocab_top_k / vocab_argmax), the per-slot penalty state is updated whole.
        assert not _vocab_collectives(eng)
    finally:
        eng.shutdown()


def _vocab_collectives(eng) -> list[str]:
    """Collectives of the steps (top-k / top-p sort variants aside: sorting a split vocabulary moves
    it) whose operand has a vocabulary-sized axis (whole or split)."""
    v = eng.config.vocab_size
    sizes = {v, -(-v // eng.runner.model.tp_size) * eng.runner.model.tp_size, -(-v // eng.runner.model.tp_size)}
    found = []
    for bucket, exe in eng.runner.compiled.items():
        if bucket.sort:
            continue
        for line in exe.as_text().splitlines():
            head = line.split("(", 1)[0]
            if any(op in line for op in ("all-gather", "all-to-all", "collective-permute")) and any(
                    f",{n}]" in head or f"[{n}]" in head or f",{n}," in head for n in sizes):
                found.append(line.strip()[:160])
    return found


def test_retraction_on_a_split_target(models, greedy_reference):
    """A pool too small for the batch: requests are retracted and re-run on the split pools (KV
    and GDN state) and still give the target's greedy text."""
    want = reference(greedy_reference, models["bigram_next"])
    eng = Engine(models["bigram_next"], page_size=4, tp_size=2, speculative_algorithm="NEXTN", speculative_num_steps=3,
                 speculative_eagle_topk=1, speculative_num_draft_tokens=4, max_total_tokens=56,
                 transfer_guard="disallow", **BASE)
    try:
        generates(eng, PROMPTS, GREEDY, want)
        info = eng.get_server_info()
        assert info["num_retractions"] > 0 and info["last_error"] is None, info["num_retractions"]
        check_no_leaks(eng)
    finally:
        eng.shutdown()


def test_speculation_with_replicated_attention(models, greedy_reference):
    """NEXTN trees (spec v2) on a split target whose attention and GDN layers are whole on every
    device (`replicate_attention`): the GDN commit of the accepted node runs on the whole state
    pools, the MoE stays split; greedy output equals the target's and drafts are kept."""
    want = reference(greedy_reference, models["bigram_next"])
    eng = Engine(models["bigram_next"], page_size=4, tp_size=2, replicate_attention=True,
                 speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=6, transfer_guard="disallow", **BASE)
    try:
        generates(eng, PROMPTS, GREEDY, want)
        info = eng.get_server_info()
        assert info["replicate_attention"] and info["last_error"] is None
        assert max(info["spec_accept_length_histogram"]) >= 3, info["spec_accept_length_histogram"]
        check_no_leaks(eng)
    finally:
        eng.shutdown()
