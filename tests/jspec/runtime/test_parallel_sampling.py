"""Parallel sampling (`n > 1`, SGLang's): n results per prompt, each sample its own request with
its own seed; the prompt is computed once and its pages shared through the prefix cache; an abort
of one sample leaves the others running and nothing leaked."""

from __future__ import annotations

import threading

import pytest

from jspec import Engine
from jspec.errors import InvalidRequestError
from tests.support import models as tm
from tests.support.engines import SMALL, check_no_leaks, output_ids

PROMPT = tm.random_ids(30, seed=5)
SAMPLED = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "seed": 11}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    with Engine(tiny_checkpoint("qwen3", 41), page_size=4, chunked_prefill_size=128, **SMALL) as eng:
        yield eng


def test_n_samples_share_the_prompt_and_follow_their_seeds(engine):
    outs = engine.generate(input_ids=PROMPT, sampling_params={**SAMPLED, "n": 4})
    assert isinstance(outs, list) and len(outs) == 4
    # Sample j is the request with seed 11 + j; the first computes the prompt, the others reuse it.
    alone = [engine.generate(input_ids=PROMPT, sampling_params={**SAMPLED, "seed": 11 + j})["output_ids"]
             for j in range(4)]
    assert output_ids(outs) == alone
    assert len({tuple(o) for o in alone}) > 1
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == 0 and all(c == 28 for c in cached[1:]), cached  # 7 full pages of 29 tokens
    check_no_leaks(engine)


def test_n_per_prompt_in_a_batch_and_greedy_samples_agree(engine):
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 3}
    outs = engine.generate(input_ids=[PROMPT, PROMPT[:17]], sampling_params=[greedy, {**greedy, "n": 2}])
    assert len(outs) == 5
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) == 1 and outs[3]["output_ids"] == outs[4]["output_ids"]
    with pytest.raises(InvalidRequestError, match="sampling_params.n"):
        engine.generate(input_ids=PROMPT, sampling_params={"n": 0})
    with pytest.raises(InvalidRequestError, match="sampling_params.n"):
        engine.generate(input_ids=PROMPT, sampling_params={"n": 2}, stream=True)
    check_no_leaks(engine)


def test_aborting_one_sample_keeps_the_others(engine):
    result = {}
    t = threading.Thread(target=lambda: result.update(outs=engine.generate(
        input_ids=PROMPT, sampling_params={**SAMPLED, "max_new_tokens": 60, "n": 3}, rid="par")))
    t.start()
    while not engine.abort("par-1"):
        assert t.is_alive()
    t.join(timeout=120)
    outs = result["outs"]
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length", "abort", "length"]
    assert [len(o["output_ids"]) for o in outs][::2] == [60, 60]
    check_no_leaks(engine)
