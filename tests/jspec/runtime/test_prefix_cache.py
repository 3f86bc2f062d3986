"""The prefix cache in the engine (dense targets, no speculation): prompts that share a system
prompt reuse its pages and give the same greedy text as without the cache; `cached_tokens`, the
hit rate and evictable pages are reported; unused cached pages are evicted before anyone is
retracted; requests with penalties compute their whole prompt; `flush_cache` empties it; where it
is not supported yet (hybrid targets, speculation) it is off and says so."""

from __future__ import annotations

import pytest

from jspec import Engine
from tests.support import models as tm
from tests.support.engines import SMALL, check_no_leaks, output_ids

SYSTEM = tm.random_ids(37, seed=77)
PROMPTS = [SYSTEM + tm.random_ids(n, seed=500 + n) for n in (3, 6, 1, 9)]
GREEDY = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
SETTINGS = {**SMALL, "cuda_graph_bs": [4], "chunked_prefill_size": 64, "context_length": 96}


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("qwen3", 41)


@pytest.fixture(scope="module")
def no_cache(target):
    with Engine(target, page_size=4, disable_radix_cache=True, **SETTINGS) as eng:
        assert eng.get_server_info()["radix_cache"] is False
        return output_ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))


def test_shared_prefix_is_reused_and_output_unchanged(target, no_cache):
    with Engine(target, page_size=4, transfer_guard="disallow", **SETTINGS) as eng:
        first = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert output_ids(outs) == no_cache
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert all(c >= 36 for c in cached), cached  # the 37-token system prompt: its 9 full pages
        info = eng.get_server_info()
        assert info["radix_cache"] and info["cache_hit_rate"] > 0.5 and info["num_evictable_pages"] > 0
        again = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)  # its whole prompt is cached now
        assert again["output_ids"] == no_cache[1] and again["meta_info"]["cached_tokens"] == 40
        check_no_leaks(eng)  # flushes the cache first
        assert eng.get_server_info()["num_cached_pages"] == 0


def test_cached_pages_are_evicted_before_retraction(target, no_cache):
    """A pool that holds the batch but not the batch plus everything cached: admission evicts."""
    with Engine(target, page_size=4, max_total_tokens=4 * 56, **SETTINGS) as eng:
        for i in range(6):  # fill the cache with unrelated prompts
            eng.generate(input_ids=tm.random_ids(40, seed=900 + i), sampling_params=GREEDY)
        assert eng.get_server_info()["num_cached_pages"] > 20
        assert output_ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == no_cache
        info = eng.get_server_info()
        assert info["num_retractions"] == 0, info["num_retractions"]
        check_no_leaks(eng)


def test_requests_with_penalties_compute_their_whole_prompt(target):
    with Engine(target, page_size=4, **SETTINGS) as eng:
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        pen = eng.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "repetition_penalty": 1.3})
        plain = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert pen["meta_info"]["cached_tokens"] == 0 and plain["meta_info"]["cached_tokens"] > 0
        check_no_leaks(eng)


def test_off_where_not_supported_yet(tiny_checkpoint):
    with Engine(tiny_checkpoint("qwen3_next", 5), page_size=4, **SETTINGS) as eng:
        assert eng.get_server_info()["radix_cache"] is False and eng.flush_cache() is False


def test_page_size_one_reuses_all_but_the_last_token(target):
    with Engine(target, page_size=1, **SETTINGS) as eng:
        first = eng.generate(input_ids=PROMPTS[3], sampling_params=GREEDY)
        second = eng.generate(input_ids=PROMPTS[3], sampling_params=GREEDY)
        assert second["meta_info"]["cached_tokens"] == len(PROMPTS[3]) - 1
        assert second["output_ids"] == first["output_ids"]
        check_no_leaks(eng)
