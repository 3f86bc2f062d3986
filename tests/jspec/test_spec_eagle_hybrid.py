"""Speculative decoding on the hybrid Qwen3-Next target (Gated-DeltaNet state next to paged KV):
its MTP layer as an agreeing drafter (NEXTN, chain and tree: multi-token acceptance, commits past
node 0 and the drafter's catch-up, spec v2 under the transfer guard and against spec v1),
NAIVE_EAGLE with the MTP layer, NGRAM overlapped, and a target without MTP tensors refused. Split
from test_spec_eagle_agree.py (the dense target) so that `-n 2 --dist loadfile` runs the two side
by side; shared set-up and checks: spec_eagle_common.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import tiny_models as tm  # noqa: E402
from spec_checks import leak_free  # noqa: E402
from spec_eagle_common import (BASE, GREEDY, PROMPTS, build_models, check_agreeing_drafter,  # noqa: E402
                               check_naive_eagle, reference, spec_engine)

from jspec import Engine  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("hybrid"), ("bigram_next",))


# The dense target's EAGLE drafter, chain and tree: test_spec_eagle_agree.py.
@pytest.mark.parametrize("algo,target,draft,topk,ndt,compare_v1", [
    ("NEXTN", "bigram_next", None, 1, 4, True),
    ("NEXTN", "bigram_next", None, 2, 6, False),
])
def test_agreeing_drafters_are_accepted_and_exact(models, algo, target, draft, topk, ndt, compare_v1):
    check_agreeing_drafter(models, algo, target, draft, topk, ndt, compare_v1)


def test_naive_eagle_one_fused_step(models):
    """NAIVE_EAGLE with the target's MTP layer (no draft path); with an EAGLE drafter:
    test_spec_eagle_agree.py."""
    check_naive_eagle(models, "bigram_next", None)


def test_ngram_on_a_hybrid_target_overlapped(models):
    """NGRAM in spec v2 on a Qwen3-Next target: a near-bigram model's greedy text repeats itself
    enough that some device-side drafts are kept, so the Gated-DeltaNet state is committed past
    node 0; the loop runs under transfer_guard("disallow")."""
    ref = reference(models["bigram_next"], 4)
    eng = spec_engine(models, "NGRAM", "bigram_next", None, steps=3, topk=1, ndt=4, page_size=4,
                      transfer_guard="disallow")
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == ref
        info = eng.get_server_info()
        hist = info["spec_accept_length_histogram"]
        assert info["last_error"] is None and max(hist) >= 3, hist  # commits past node 0 happened
        leak_free(eng)
    finally:
        eng.shutdown()


def test_nextn_needs_mtp_tensors(tmp_path):
    bare = str(tmp_path / "no_mtp")
    tm.build("qwen3_next", bare, seed=8)
    with pytest.raises(Exception, match="mtp"):
        Engine(bare, page_size=4, speculative_algorithm="NEXTN", **BASE)
