"""Speculative decoding on the hybrid Qwen3-Next target (Gated-DeltaNet state next to paged KV):
its MTP layer as an agreeing drafter (NEXTN, chain and tree: multi-token acceptance, commits past
node 0 and the drafter's catch-up, spec v2 under the transfer guard and against spec v1),
NAIVE_EAGLE with the MTP layer, NGRAM overlapped, and a target without MTP tensors refused. Split
from test_spec_eagle_agree.py (the dense target) so that `-n 2 --dist loadfile` runs the two side
by side; shared set-up and checks: tests/support/spec_eagle.py."""

from __future__ import annotations

import pytest

from jspec import Engine
from tests.support.engines import check_no_leaks, generates
from tests.support.spec_eagle import (BASE, GREEDY, PROMPTS, build_models, check_agreeing_drafter, check_naive_eagle,
                                      reference, spec_engine)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    return build_models(tmp_path_factory.mktemp("hybrid"), ("bigram_next",), tiny_checkpoint)


# The dense target's EAGLE drafter, chain and tree: test_spec_eagle_agree.py.
@pytest.mark.parametrize("algo,target,draft,topk,ndt,compare_v1", [
    ("NEXTN", "bigram_next", None, 1, 4, True),
    ("NEXTN", "bigram_next", None, 2, 6, False),
])
def test_agreeing_drafters_are_accepted_and_exact(models, greedy_reference, algo, target, draft, topk, ndt,
                                                  compare_v1):
    ref = reference(greedy_reference, models[target])
    check_agreeing_drafter(models, algo, target, draft, topk, ndt, compare_v1, ref)


def test_naive_eagle_one_fused_step(models, greedy_reference):
    """NAIVE_EAGLE with the target's MTP layer (no draft path); with an EAGLE drafter:
    test_spec_eagle_agree.py."""
    check_naive_eagle(models, "bigram_next", None, reference(greedy_reference, models["bigram_next"]))


def test_ngram_on_a_hybrid_target_overlapped(models, greedy_reference):
    """NGRAM in spec v2 on a Qwen3-Next target: a near-bigram model's greedy text repeats itself
    enough that some device-side drafts are kept, so the Gated-DeltaNet state is committed past
    node 0; the loop runs under transfer_guard("disallow")."""
    ref = reference(greedy_reference, models["bigram_next"])
    eng = spec_engine(models, "NGRAM", "bigram_next", None, steps=3, topk=1, ndt=4, page_size=4,
                      transfer_guard="disallow")
    try:
        generates(eng, PROMPTS, GREEDY, ref)
        info = eng.get_server_info()
        hist = info["spec_accept_length_histogram"]
        assert info["last_error"] is None and max(hist) >= 3, hist  # commits past node 0 happened
        check_no_leaks(eng)
    finally:
        eng.shutdown()


def test_nextn_needs_mtp_tensors(tiny_checkpoint):
    bare = tiny_checkpoint("qwen3_next", 8)
    with pytest.raises(Exception, match="mtp"):
        Engine(bare, page_size=4, speculative_algorithm="NEXTN", **BASE)
