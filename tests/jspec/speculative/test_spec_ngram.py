"""NGRAM speculative decoding (the device-side matcher against a plain reference, greedy exactness
synchronous and overlapped, acceptance on repetitive text, settings), and the sampling-distribution
tests of both chain drafters (STANDALONE and NGRAM). Split from test_spec_chain.py so that
`-n 2 --dist loadfile` runs the two files side by side; shared set-up: tests/support/spec_chain.py."""

from __future__ import annotations

import pytest

from jspec import Engine
from jspec.errors import ConfigError
from jspec.models.batch import ForwardMode
from tests.support import models as tm
from tests.support.engines import check_no_leaks, generates
from tests.support.spec import DRAWS, second_token_follows_target, two_token_draws
from tests.support.spec_chain import BASE, GREEDY, PROMPTS


# --------------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def standalone_draws(chain_dirs):
    """One STANDALONE engine for both STANDALONE sampling cases: it compiles the step with and
    without the top-k / top-p sort, and a request at top_p 1 runs the sort-free step, the very
    program an engine started with disable_top_k_top_p compiles (ModelRunner: one bucket per
    sort variant, chosen per batch by whether any request needs the sort)."""
    target, draft = chain_dirs
    eng = Engine(target, page_size=4, speculative_algorithm="STANDALONE", speculative_num_steps=2,
                 speculative_draft_model_path=draft, **{**BASE, **DRAWS, "disable_top_k_top_p": False})
    assert sorted(b.sort for b in eng.runner.buckets if b.mode is ForwardMode.DECODE) == [False, True]
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("algo,temperature,top_p", [("STANDALONE", 1.0, 1.0), ("STANDALONE", 0.7, 0.9),
                                                    ("NGRAM", 1.0, 1.0)])
def test_speculative_sampling_follows_the_target_distribution(request, chain_dirs, algo, temperature, top_p):
    """The second output token always comes out of a speculative step (accepted draft or residual
    draw). Given the first token, its law must be the target's own, not the drafter's: chi-square
    of its counts against transformers' distribution for each observed first token."""
    target = chain_dirs[0]
    prompt = tm.random_ids(6, seed=77)
    if algo == "STANDALONE":
        eng = request.getfixturevalue("standalone_draws")
        outs = two_token_draws(eng, prompt, 1500, temperature, top_p)
    else:
        eng = Engine(target, page_size=4, speculative_algorithm=algo, speculative_num_steps=2,
                     **{**BASE, **DRAWS, "disable_top_k_top_p": top_p == 1.0})
        try:
            outs = two_token_draws(eng, prompt, 1500, temperature, top_p)
        finally:
            eng.shutdown()
    second_token_follows_target(outs, prompt, target, temperature, top_p)


# ------------------------------------------------------------------------------------ NGRAM
def ngram_reference(ids: list[int], num_tokens: int, min_window: int, max_window: int) -> list[int]:
    """NGRAM's draft, plainly: for the longest window n (max_window down to min_window) whose
    suffix ids[-n:] also ends at an earlier position e < len(ids) - 1, the tokens after the latest
    such e, cut at the end of ids and padded with the last one; no match: the newest token."""
    last = len(ids) - 1
    for n in range(min(max_window, len(ids)), min_window - 1, -1):
        suffix = ids[last - n + 1:]
        ends = [e for e in range(n - 1, last) if ids[e - n + 1:e + 1] == suffix]
        if ends:
            draft = ids[ends[-1] + 1:ends[-1] + 1 + num_tokens]
            return (draft + [draft[-1]] * num_tokens)[:num_tokens]
    return [ids[-1]] * num_tokens


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

    from jspec.speculative import ngram

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


# v2 (overlapped, the default loop) compiles the batch-1 / 2 / 4 steps; the synchronous loop (v1)
# differs from it on the host, not in the step code (ModelRunner builds the same step for both),
# so its engine compiles the batch-4 step only (CI time; fewer requests run padded into it).
@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
def test_ngram_exact_and_accepts_on_repetitive_text(chain_dirs, chain_reference, overlap):
    """Greedy NGRAM equals greedy decoding, synchronous (v1) and overlapped (v2, the loop under
    transfer_guard("disallow"): the drafts come from the device, nothing is read back early)."""
    extra = dict(transfer_guard="disallow") if overlap else dict(disable_overlap_schedule=True, cuda_graph_bs=[4])
    eng = Engine(chain_dirs[0], page_size=4, speculative_algorithm="NGRAM", speculative_num_steps=4,
                 speculative_ngram_max_match_window_size=4, **{**BASE, **extra})
    try:
        generates(eng, PROMPTS, GREEDY, chain_reference)
        pattern = tm.random_ids(6, seed=9)
        rep = eng.generate(input_ids=pattern * 5, sampling_params=dict(GREEDY, max_new_tokens=40))
        assert rep["meta_info"]["spec_accept_length"] > 2, rep["meta_info"]
        assert eng.get_server_info()["last_error"] is None
        check_no_leaks(eng)
    finally:
        eng.shutdown()


def test_ngram_rejects_a_draft_model(chain_dirs):
    with pytest.raises(ConfigError, match="NGRAM"):
        Engine(chain_dirs[0], speculative_algorithm="NGRAM", speculative_draft_model_path=chain_dirs[1], **BASE)
