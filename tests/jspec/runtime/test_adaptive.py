"""Speculation that never loses: the per-step choice (`jspec.runtime.adaptive.SpecPolicy`) and the
plain step that keeps each drafter current (`jspec.speculative.plain_step`), so that greedy
output stays the target's and drafting after a pause is as good as without one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jspec import Engine
from jspec.errors import ConfigError
from jspec.runtime.adaptive import SpecPolicy
from jspec.tiny import tiny_dir

# Batch buckets 1 and 4 and one prompt bucket of 16 tokens (every prompt below, and all three at
# once, fit one chunk): the fewest step variants that still run a request alone and a padded batch.
SMALL = dict(dtype="float32", cuda_graph_bs=[1, 4], max_running_requests=4, chunked_prefill_size=16,
             prefill_token_buckets=[16], context_length=160, show_progress=False, compilation_cache_dir="none",
             disable_top_k_top_p=True)
PROMPTS = [[3, 17, 29, 8, 41, 5, 77], [12, 9, 4, 4, 60], [33, 2, 90, 15]]
SP = [{"max_new_tokens": n, "temperature": 0} for n in (48, 10, 10)]
QWEN3, NEXT = tiny_dir("qwen3"), tiny_dir("qwen3-next")
DRAFTERS = {
    "eagle3": (QWEN3, dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=tiny_dir("qwen3-eagle3"),
                           speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)),
    "eagle3_tree": (QWEN3, dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=tiny_dir("qwen3-eagle3"),
                                speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5)),
    "nextn_hybrid": (NEXT, dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1,
                                speculative_num_draft_tokens=4)),
    "dflash": (QWEN3, dict(speculative_algorithm="DFLASH", speculative_draft_model_path=tiny_dir("qwen3-dflash"))),
    "standalone": (QWEN3, dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny_dir("qwen3-draft"),
                               speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)),
    "ngram": (QWEN3, dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4)),
}


@pytest.fixture(scope="module")
def plain_outputs():
    out = {}
    for path in (QWEN3, NEXT):
        with Engine(path, **SMALL) as eng:
            out[path] = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=SP)]
    return out


@pytest.fixture(scope="module")
def small_engines():
    """`small_engines(name)`: one engine per drafter at batch sizes 1 and 4, kept for the module;
    EAGLE3's is adaptive (the default), shared by the two tests below, each setting the policy's
    knobs it needs; NEXTN's is built with the capped policy its one test uses."""
    engines = {}

    def get(name):
        if name not in engines:
            path, spec = DRAFTERS[name]
            knobs = {} if name == "eagle3" else dict(speculative_adaptive=False, speculative_disable_by_batch_size=2)
            engines[name] = Engine(path, **SMALL, **spec, **knobs)
        return engines[name]

    yield get
    for eng in engines.values():
        eng.shutdown()


def _policy_counts(eng) -> tuple[dict, dict, int]:
    info = eng.get_server_info()
    return dict(info["speculative_policy"]), dict(info["spec_accept_length_histogram"]), info["num_steps"]["decode"]


@pytest.mark.parametrize("name", ["eagle3", "nextn_hybrid"])  # every drafter: the test below
def test_switching_both_ways_keeps_greedy_output(name, plain_outputs, small_engines):
    """The long prompt alone first (speculating throughout: the reference accept length), then
    all three: while two or more run the engine decodes plainly (vLLM's cap), then the long one
    speculates again. Greedy output is the target's, and the drafts after the pause are accepted
    about as well as before it (a drafter that missed the paused positions would draft from stale
    KV / context / history)."""
    path, _ = DRAFTERS[name]
    eng = small_engines(name)
    eng.policy.adaptive, eng.policy.disable_by_batch_size = False, 2
    assert eng.flush_cache()
    start = _policy_counts(eng)
    alone = eng.generate(input_ids=PROMPTS[0], sampling_params=SP[0])
    first = _policy_counts(eng)
    got = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=SP)]
    end = _policy_counts(eng)
    assert alone["output_ids"] == plain_outputs[path][0]
    assert got == plain_outputs[path]

    def steps(a, b, key):
        return b[0][key] - a[0][key]

    def hist(a, b):
        return {k: v - a[1].get(k, 0) for k, v in b[1].items() if v - a[1].get(k, 0)}

    assert steps(start, first, "num_plain_steps") == 0
    assert steps(first, end, "num_plain_steps") >= 5 and steps(first, end, "num_spec_steps") >= 3, end[0]
    assert end[2] - first[2] == steps(first, end, "num_plain_steps")  # the plain steps are the decode steps
    after, before = hist(first, end), hist(start, first)
    assert _mean(after) >= 0.75 * _mean(before), (name, after, before)


def _mean(hist: dict) -> float:
    return sum(k * v for k, v in hist.items()) / sum(hist.values())


def test_adaptive_engine_measures_and_reports_its_choices(plain_outputs, small_engines):
    path, _ = DRAFTERS["eagle3"]
    eng = small_engines("eagle3")
    eng.policy.adaptive, eng.policy.disable_by_batch_size = True, None  # the engine's own default
    got = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=SP)]
    policy = eng.get_server_info()["speculative_policy"]
    assert got == plain_outputs[path]
    assert policy["speculative_adaptive"] is True
    assert set(policy["step_times_ms"]) == {1, 4}
    assert all(t["plain"] > 0 and t["spec"] > 0 and t["drafts_1"] > 0 and t["drafts_2"] > 0
               for t in policy["step_times_ms"].values())  # EAGLE3 3/1/4: chains of 1 and 2 as well
    assert policy["num_spec_steps"] + policy["num_plain_steps"] == sum(
        sum(c.values()) for c in policy["choices_by_batch"].values())


def test_policy_speculates_only_where_it_pays():
    p = SpecPolicy(step_times={1: {0: 1.0, 3: 1.2}, 32: {0: 2.0, 3: 7.0}}, probe_every=4, max_drafts=3)
    assert p.speculate(32, 30)  # nothing observed yet: speculate
    p.observe([3, 3, 2, 4])
    assert p.accept_length == 3.0 and p.kept_at_least == [1.0, 0.75, 0.25]
    assert p.speculate(1, 1)  # 3 tokens in 1.2 beat 1 token in 1.0
    assert [p.speculate(32, 30) for _ in range(8)] == [False, False, False, True] * 2  # 3 * 2.0 < 7.0; every 4th probes
    p.observe([1] * 8)  # the drafts stopped being accepted: the running mean moves towards 1
    assert p.accept_length == pytest.approx(0.9 * 3 + 0.1 * 1)
    info = p.info()
    p.choose(32, 30)
    assert info["choices_by_batch"][32] == {"plain": 6, "spec": 3}  # a snapshot: later choices leave it
    capped = SpecPolicy(adaptive=False, disable_by_batch_size=8, max_drafts=3)
    assert capped.choose(4, 7) == 3 and capped.choose(8, 8) == 0
    assert SpecPolicy(adaptive=False, max_drafts=3).speculate(256, 256)


def test_policy_picks_the_draft_length_with_the_most_tokens_per_second():
    """E(k) = 1 + P(n >= 1) + ... + P(n >= k): with the first draft kept 90% of the time and the
    later ones rarely, one draft beats three where verifying tokens costs time, and a step that
    drafted one token updates P(n >= 1) only."""
    times = {1: {0: 1.0, 1: 1.02, 2: 1.04, 3: 1.06}, 64: {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5}}
    p = SpecPolicy(step_times=times, max_drafts=3, probe_every=3)
    p.observe([2] * 9 + [1])  # n = 1 for nine requests, 0 for one: P(n>=1) .9, P(n>=2) = P(n>=3) = 0
    assert p.expected_tokens(1) == pytest.approx(1.9) and p.expected_tokens(3) == pytest.approx(1.9)
    assert p.best(1) == 1  # 1.9 / 1.02 is the best rate at batch 1 (extra drafts cost, never pay)
    assert p.best(64) == 1  # 1.9 / 1.5 > 1 / 1.0 > 1.9 / 2.0
    assert [p.choose(64, 60) for _ in range(3)] == [1, 1, 3]  # the third probes the full chain
    p.observe([1] * 10, num_drafts=1)  # one-draft steps: nothing kept -> only P(n>=1) moves
    assert p.kept_at_least[0] == pytest.approx(0.9 * 0.9) and p.kept_at_least[1:] == [0.0, 0.0]
    p.kept_at_least = [0.9, 0.8, 0.7]  # a drafter the target agrees with: the longest chain pays
    assert p.best(1) == 3 and p.best(64) == 3  # 3.4 / 2.5 > 2.7 / 2.0 > 1.9 / 1.5 > 1
    assert p.info()["step_times_ms"][64] == {"plain": 1000.0, "drafts_1": 1500.0, "drafts_2": 2000.0,
                                             "spec": 2500.0, "speculate": True, "best_num_drafts": 3}


def test_policy_knobs_are_validated():
    with pytest.raises(ConfigError, match="speculative_disable_by_batch_size=0"):
        Engine(QWEN3, **SMALL, speculative_algorithm="NGRAM", speculative_disable_by_batch_size=0)
    with pytest.raises(ConfigError, match="speculative_adaptive='yes'"):
        Engine(QWEN3, **SMALL, speculative_algorithm="NGRAM", speculative_adaptive="yes")


ONE = {**SMALL, "cuda_graph_bs": [1], "max_running_requests": 1}
PLAIN_SP = {"max_new_tokens": 12, "temperature": 0}


def _drafter_view(eng, length: int) -> dict:
    """What the drafter carries for the engine's one request slot (slot 1): its per-slot state,
    and its KV at the request's first `length` positions (read through the page table)."""
    state, slot, page = eng.runner.state, 1, eng.engine_config.page_size
    view = {f"spec_state.{k}": np.asarray(v[slot]) for k, v in (state.spec_state or {}).items()}
    if "spec_state.history" in view:  # NGRAM: positions past the request hold rejected drafts
        view["spec_state.history"] = view["spec_state.history"][:length]
    if state.draft_caches is not None:
        pos = np.arange(length)
        pages = np.asarray(state.req_to_page[slot])[pos // page]
        for i, (kp, vp) in enumerate(state.draft_caches.kv):
            view[f"draft_kv.{i}.k"] = np.asarray(kp)[pages, pos % page]
            view[f"draft_kv.{i}.v"] = np.asarray(vp)[pages, pos % page]
    return view


@pytest.fixture(scope="module")
def adaptive_runs():
    """`adaptive_runs(name)`: one adaptive engine per drafter (every variant compiled, batch 1),
    run twice with the policy's choice replaced: cycling through plain, every shorter variant and
    the configured step over PROMPTS; then plain steps only for PROMPTS[0] (prefix cache flushed
    first), with the drafter's view after it. Shared by the two tests below (one engine each);
    the engines stay up for the module (`adaptive_runs.engines`)."""
    done, engines = {}, {}

    def run(name):
        if name not in done:
            path, spec = DRAFTERS[name]
            eng = engines[name] = Engine(path, **ONE, **spec)  # speculative_adaptive is on by default
            shorter = eng.runner.drafting.shorter_chains
            ks = [0, *shorter, eng.policy.max_drafts]
            cycle, ran = itertools.cycle(ks), []
            eng.policy.choose = lambda b, n: ran.append(next(cycle)) or ran[-1]
            got = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=SP)]
            kinds = {(b.speculate, b.draft_steps) for b in eng.runner.buckets if b.mode.value == "decode"}
            assert eng.flush_cache()
            before = eng.get_server_info()["num_steps"]["decode"]
            eng.policy.choose = lambda b, n: 0
            plain = eng.generate(input_ids=PROMPTS[0], sampling_params=PLAIN_SP)["output_ids"]
            plain_steps = eng.get_server_info()["num_steps"]["decode"] - before
            view = _drafter_view(eng, len(PROMPTS[0]) + len(plain) - 1)
            done[name] = dict(shorter=shorter, ks=ks, ran=ran, got=got, kinds=kinds, plain=plain,
                              plain_steps=plain_steps, view=view)
        return done[name]

    run.engines = engines
    yield run
    for eng in engines.values():
        eng.shutdown()


@pytest.mark.parametrize("name", ["eagle3", "eagle3_tree", "nextn_hybrid", "standalone", "ngram", "dflash"])
def test_every_draft_length_keeps_greedy_output(name, plain_outputs, adaptive_runs):
    """Decode steps that cycle through plain, every shorter variant and the configured step (for a
    3-step chain: 0, 1, 2 and 3 drafts per request; a 3-deep tree of topk 2 and 5 nodes: trees 1
    and 2 deep of 3 and 5 nodes; a DFlash block verifies its first 1 or S // 2 drafts) give the
    target's greedy text, and each variant ran (the policy's own choice is replaced by the cycle)."""
    r = adaptive_runs(name)
    assert len(r["shorter"]) >= 2 and r["kinds"] == {(False, 0), (True, 0), *((True, k) for k in r["shorter"])}
    assert set(r["ran"]) == set(r["ks"])
    assert r["got"] == plain_outputs[DRAFTERS[name][0]]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_a_plain_step_leaves_the_drafter_as_a_rejected_speculation_would(name, adaptive_runs):
    """A speculative step whose drafts are all rejected (simulated accept length 1) and a plain
    step both commit one sampled token; the drafter must then carry exactly the same thing (KV of
    every accepted position, proposals, hidden, history), or switching back would draft from a
    state the target never produced. The plain steps: `adaptive_runs`' second run."""
    path, spec = DRAFTERS[name]
    ids = PROMPTS[0]
    with Engine(path, **ONE, **spec, speculative_adaptive=False, speculative_simulate_accept_length=1.0) as eng:
        out = eng.generate(input_ids=ids, sampling_params=PLAIN_SP)["output_ids"]
        assert eng.get_server_info()["num_steps"]["spec"] >= 10
        # The last output token is the next step's input, not in any cache yet.
        rejected = _drafter_view(eng, len(ids) + len(out) - 1)
    plain = adaptive_runs(name)
    assert plain["plain_steps"] >= 10 and out == plain["plain"]
    assert rejected.keys() == plain["view"].keys() and rejected
    for key in rejected:
        np.testing.assert_allclose(plain["view"][key], rejected[key], rtol=2e-5, atol=2e-5, err_msg=f"{name}: {key}")


def test_plain_steps_sample_too(adaptive_runs):
    """Sampling rows in plain steps (temperature > 0): a seeded request gives the same tokens twice,
    all within the vocabulary, and the engine stays leak-free in between (NGRAM's adaptive engine,
    its policy held at plain steps)."""
    adaptive_runs("ngram")
    eng = adaptive_runs.engines["ngram"]
    eng.policy.choose = lambda b, n: 0
    assert eng.flush_cache()
    spec_before = eng.get_server_info()["num_steps"]["spec"]
    sp = {"max_new_tokens": 10, "temperature": 0.8, "seed": 7}
    a = eng.generate(input_ids=PROMPTS[1], sampling_params=sp)["output_ids"]
    b = eng.generate(input_ids=PROMPTS[1], sampling_params=sp)["output_ids"]
    assert eng.flush_cache()
    info = eng.get_server_info()
    assert a == b and len(a) == 10 and all(0 <= t < eng.config.vocab_size for t in a)
    assert info["num_steps"]["spec"] == spec_before and info["num_free_pages"] == info["num_total_pages"]
