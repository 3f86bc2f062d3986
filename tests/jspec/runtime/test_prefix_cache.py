"""The prefix cache in the engine (dense targets, no speculation): prompts that share a system
prompt reuse its pages and give the same greedy text as without the cache; `cached_tokens`, the
hit rate and evictable pages are reported; unused cached pages are evicted before anyone is
retracted; requests with penalties reuse the cached prompt (a repetition penalty's slot seeded
with its tokens); `flush_cache` empties it. Hybrid
targets reuse pages up to a cached Gated-DeltaNet state snapshot, taken where prompt chunks end, inside
long chunks and at branch points. Under speculation: tests/jspec/speculative/test_spec_prefix_cache.py."""

from __future__ import annotations

import pytest

from jspec import Engine
from jspec.runtime import startup_runs
from jspec.errors import ConfigError
from tests.support import models as tm
from tests.support.engines import SMALL, check_no_leaks, output_ids

SYSTEM = tm.random_ids(37, seed=77)
PROMPTS = [SYSTEM + tm.random_ids(n, seed=500 + n) for n in (3, 6, 1, 9)]
GREEDY = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
# One prompt bucket of 64 tokens (a shorter chunk runs padded into it) and no top-k / top-p sampler
# variants: three compiled steps per engine.
SETTINGS = {**SMALL, "cuda_graph_bs": [4], "chunked_prefill_size": 64, "prefill_token_buckets": [64],
            "context_length": 96, "disable_top_k_top_p": True}


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("qwen3", 41)


@pytest.fixture(scope="module")
def no_cache(target):
    with Engine(target, page_size=4, disable_radix_cache=True, **SETTINGS) as eng:
        assert eng.get_server_info()["radix_cache"] is False
        return output_ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))


def test_shared_prefix_is_reused_and_output_unchanged(target, no_cache):
    """Also with prompt steps first (`prefill_first`): the four prompts of a batch run their chunks
    before anyone decodes, which changes the steps' make-up, not the output."""
    with Engine(target, page_size=4, transfer_guard="disallow", prefill_first=True, **SETTINGS) as eng:
        assert eng.get_server_info()["prefill_first"] is True
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
        # Uncached, with an unrelated prompt behind three of them, the batch takes two 64-token
        # prompt steps. Alternating, the first requests would decode between them (9 decode steps
        # in all); prompt steps first, 8 steps decode all four after the last chunk.
        before = dict(eng.get_server_info()["num_steps"])
        outs = output_ids(eng.generate(input_ids=PROMPTS[:3] + [tm.random_ids(40, seed=990)], sampling_params=GREEDY))
        assert outs[:3] == no_cache[:3]
        after = eng.get_server_info()["num_steps"]
        assert after["extend"] - before["extend"] >= 2 and after["decode"] - before["decode"] == 8


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


def test_penalised_requests_reuse_the_cached_prompt_and_give_the_uncached_output(target):
    """Penalties count what steps feed. Frequency and presence penalties count outputs only; a
    repetition penalty counts prompt tokens too, so a request that reuses a cached prompt has its
    slot seeded with the cached tokens first. Either way the output is that without the cache."""
    freq = {**GREEDY, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    rep = {**GREEDY, "repetition_penalty": 1.8}
    with Engine(target, page_size=4, transfer_guard="disallow", **SETTINGS) as eng:
        for sp in (freq, rep, {**rep, **freq}):
            assert eng.flush_cache()
            uncached = eng.generate(input_ids=PROMPTS[1], sampling_params=sp)
            # A batch, so a seeded slot sits beside reset ones in the same prompt step.
            cached = eng.generate(input_ids=[PROMPTS[1], PROMPTS[2]], sampling_params=[sp, GREEDY])[0]
            assert uncached["meta_info"]["cached_tokens"] == 0 and cached["meta_info"]["cached_tokens"] == 40
            assert cached["output_ids"] == uncached["output_ids"], sp
            greedy = eng.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
            assert greedy["output_ids"] != cached["output_ids"], sp  # the penalties do change this output
        check_no_leaks(eng)


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint):
    return tiny_checkpoint("qwen3_next", 5)


@pytest.fixture(scope="module")
def hybrid_no_cache(hybrid):
    with Engine(hybrid, page_size=4, disable_radix_cache=True, **SETTINGS) as eng:
        info = eng.get_server_info()
        assert info["radix_cache"] is False and eng.flush_cache() is False
        assert info["max_mamba_cache_size"] == 4  # no snapshot rows without the cache
        return output_ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))


def test_hybrid_snapshots_branch_points_and_exactness(hybrid, hybrid_no_cache):
    """A Gated-DeltaNet target reuses pages only up to a cached state snapshot. The first prompt
    leaves one at its end (40 tokens, one chunk); the second shares only the 37-token system prompt
    with it: its pages match 36 tokens but no snapshot does, so it prefills everything with a chunk
    cut at 36, which leaves a snapshot there; from the third on, 36 tokens are reused. Arriving
    together on an empty cache, the first is cut at 36 instead and the rest reuse its snapshot."""
    with Engine(hybrid, page_size=4, transfer_guard="disallow", **SETTINGS) as eng:
        info = eng.get_server_info()
        assert info["radix_cache"] and info["num_state_snapshots"] == 4  # default: one per running request
        cached = []
        for i, p in enumerate(PROMPTS):
            out = eng.generate(input_ids=p, sampling_params=GREEDY)
            assert out["output_ids"] == hybrid_no_cache[i], i
            cached.append(out["meta_info"]["cached_tokens"])
        assert cached == [0, 0, 36, 36], cached
        # The start-up warm-up (every bucket on padding rows) writes nothing a cached page, a
        # snapshot or a slot holds: run over this cache, it leaves the next answers unchanged.
        assert eng.wait_idle(30) and startup_runs.warm_up(eng.runner) == len(eng.runner.buckets)
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # all at once, all cached
        assert output_ids(outs) == hybrid_no_cache
        assert all(o["meta_info"]["cached_tokens"] >= 36 for o in outs)
        assert eng.get_server_info()["num_cached_states"] > 0
        # All at once on an empty cache: the first prompt's chunk ends where the others share its
        # pages (36 tokens), leaving a snapshot there; they wait a step for it instead of each
        # recomputing the system prompt.
        assert eng.flush_cache()
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert output_ids(outs) == hybrid_no_cache
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 36, 36, 36]
        check_no_leaks(eng)  # every snapshot row is free again after the flush


def test_hybrid_decode_keeps_the_state_of_what_it_generated(hybrid):
    """With a track interval of 8, decoding past 48 tokens keeps the GDN state there: the next turn
    of the chat (prompt + reply + a new question) reuses 48 tokens, the reply's included, and
    answers as it does from scratch."""
    with Engine(hybrid, page_size=4, mamba_track_interval=6, **SETTINGS) as eng:
        assert eng.get_server_info()["mamba_track_interval"] == 8  # rounded up to whole pages
        first = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)  # 40 + 9 tokens
        follow = PROMPTS[0] + first["output_ids"] + tm.random_ids(5, seed=901)
        cached = eng.generate(input_ids=follow, sampling_params=GREEDY)
        assert cached["meta_info"]["cached_tokens"] == 48
        assert eng.flush_cache()
        fresh = eng.generate(input_ids=follow, sampling_params=GREEDY)
        assert fresh["meta_info"]["cached_tokens"] == 0 and fresh["output_ids"] == cached["output_ids"]
        check_no_leaks(eng)


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_snapshots_inside_a_long_prompt_chunk(hybrid, tp):
    """A 200-token prompt prefilled in one chunk leaves snapshots inside it, about every track
    interval (64 here: at 64, 128 and 192 tokens, where the GDN kernel's 64-token chunks end), so a
    prompt branching off it at 150 tokens reuses 128 of them, and answers as from scratch; also
    with the target split over two devices (the states and conv windows split by heads)."""
    long_chunks = {**SETTINGS, "chunked_prefill_size": 256, "prefill_token_buckets": [256], "context_length": 288}
    first = tm.random_ids(200, seed=1201)
    branch = first[:150] + tm.random_ids(20, seed=1202)
    with Engine(hybrid, page_size=4, mamba_track_interval=64, transfer_guard="disallow", tp_size=tp,
                **long_chunks) as eng:
        assert eng.generate(input_ids=first, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0
        assert eng.get_server_info()["num_cached_states"] >= 4  # 64, 128, 192 and the chunk's end
        cached = eng.generate(input_ids=branch, sampling_params=GREEDY, return_logprob=True)
        assert cached["meta_info"]["cached_tokens"] == 128
        assert eng.flush_cache()
        fresh = eng.generate(input_ids=branch, sampling_params=GREEDY, return_logprob=True)
        assert fresh["meta_info"]["cached_tokens"] == 0 and fresh["output_ids"] == cached["output_ids"]
        # Logprobs too: greedy tokens of the tiny model survive a state one token off, logprobs do not.
        for (a, _, _), (b, _, _) in zip(cached["meta_info"]["output_token_logprobs"],
                                        fresh["meta_info"]["output_token_logprobs"]):
            assert abs(a - b) < 1e-4, (a, b)
        check_no_leaks(eng)


def test_hybrid_with_one_snapshot_row_stays_exact(hybrid, hybrid_no_cache):
    """Snapshots evicted (LRU) at every turn, pages evicted under a small pool: still exact."""
    with Engine(hybrid, page_size=4, max_mamba_cache_size=5, max_total_tokens=4 * 60, **SETTINGS) as eng:
        assert eng.get_server_info()["num_state_snapshots"] == 1
        for _ in range(2):
            for i in (0, 2, 1, 3):
                assert eng.generate(input_ids=PROMPTS[i], sampling_params=GREEDY)["output_ids"] == hybrid_no_cache[i]
            assert output_ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == hybrid_no_cache
        assert eng.get_server_info()["num_cached_states"] == 1
        check_no_leaks(eng)


def test_max_mamba_cache_size_must_leave_room_for_a_snapshot(hybrid):
    with pytest.raises(ConfigError, match="max_mamba_cache_size"):
        Engine(hybrid, page_size=4, max_mamba_cache_size=4, **SETTINGS)


def test_page_size_one_reuses_all_but_the_last_token(target):
    with Engine(target, page_size=1, **SETTINGS) as eng:
        first = eng.generate(input_ids=PROMPTS[3], sampling_params=GREEDY)
        second = eng.generate(input_ids=PROMPTS[3], sampling_params=GREEDY)
        assert second["meta_info"]["cached_tokens"] == len(PROMPTS[3]) - 1
        assert second["output_ids"] == first["output_ids"]
        check_no_leaks(eng)
