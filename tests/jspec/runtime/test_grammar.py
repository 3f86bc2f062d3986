"""Structured output (regex, json_schema, ebnf) on a plain engine, and its parts: the device bitmask
against llguidance's numpy oracle, the host's masks along a forced run against the matcher walked
token by token, bad grammars refused with the key named, acceptance limited to a forced run keeps
the target distribution (chi-square). Under every drafter: test_spec_penalties_logprobs.py."""

from __future__ import annotations

import json
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec import Engine
from jspec.errors import ConfigError, InvalidRequestError
from jspec.models.batch import ForwardMode
from jspec.runtime import sampler as sampling, startup_runs
from jspec.runtime.grammar import GrammarBackend, mask_words
from jspec.runtime.sampling_params import SamplingParams
from jspec.runtime.split_step import SplitExecutable
from jspec.speculative import accept
from tests.support import models as tm
from tests.support.compiles import compilations
from tests.support.engines import SMALL, check_no_leaks, until, watch_launches, watch_reads

# Compact JSON (llguidance's x-guidance option): a random model left free to add whitespace adds nothing else.
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "enum": ["ab", "cd"]}},
          "required": ["id", "tag"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
REGEX = r"ab[0-9]{1,3}-fixed-tail-[a-z]{2}"


@pytest.fixture(scope="module")
def backend():
    return GrammarBackend(tm.char_tokenizer().to_str(), tm.VOCAB, [])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("grammar_qwen3"))
    tm.build("qwen3", d, seed=5)
    tm.char_tokenizer().save(os.path.join(d, "tokenizer.json"))
    eng = Engine(d, page_size=4, chunked_prefill_size=16, context_length=96, grammar_backend="llguidance",
                 transfer_guard="disallow", **SMALL)
    yield eng
    eng.shutdown()


def _ids(text: str) -> list[int]:
    return tm.char_tokenizer().encode(text).ids


# --------------------------------------------------------------------------- parts
def test_device_bitmask_equals_llguidance_numpy_oracle(backend):
    from llguidance import numpy as llg_np

    rng = np.random.default_rng(0)
    masks = rng.integers(-2**31, 2**31, size=(3, mask_words(tm.VOCAB)), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(3, tm.VOCAB)).astype(np.float32)
    want = logits.copy()
    llg_np.apply_token_bitmask_inplace(want, masks)
    np.testing.assert_array_equal(np.asarray(sampling.apply_bitmask(jnp.asarray(logits), jnp.asarray(masks))), want)


def test_masks_along_a_forced_run_equal_the_matcher_walked_token_by_token(backend):
    g = backend.compile("regex", REGEX)
    for tok in _ids("ab123"):
        assert g.accept(tok)
    forced = g.forced(20)
    assert forced == _ids("-fixed-tail-")  # after three digits the grammar allows one thing only
    rows = np.zeros((len(forced) + 1, mask_words(tm.VOCAB)), np.int32)
    # The digit run may still go on: nothing is forced before the third digit's choice is made.
    g2 = backend.compile("regex", REGEX)
    for tok in _ids("ab1"):
        g2.accept(tok)
    assert g2.forced(5) == []
    g.fill_path(rows, forced)
    walk = backend.compile("regex", REGEX)
    for tok in _ids("ab123"):
        walk.accept(tok)
    for i, tok in enumerate(forced + [None]):
        one = np.zeros(mask_words(tm.VOCAB), np.int32)
        walk.fill(one)
        np.testing.assert_array_equal(rows[i], one)
        if tok is not None:
            walk.accept(tok)
    assert g.forced(20) == forced  # fill_path left the matcher where it was


def _mask_after(backend, text: str) -> np.ndarray:
    g = backend.compile("regex", REGEX)
    for tok in _ids(text):
        assert g.accept(tok)
    row = np.zeros(mask_words(tm.VOCAB), np.int32)
    g.fill(row)
    return row


def test_a_split_step_walks_each_constrained_rows_grammar_along_its_draft_tree(backend):
    """draft_inputs: the nodes whose path the grammar allows are walkable, each with the mask of
    the state its path reaches; a forbidden node is marked to be tried (its parent's mask rejects it)
    and nothing under it is walkable (the grammar is broken there); where the grammar forces a run, the row
    verifies that run instead, unless told not to (a pipelined step whose forward over the drafts is
    queued already: they are walked like any other), and says a run was forced; unconstrained rows
    keep all."""
    from types import SimpleNamespace

    from jspec.runtime.grammar import draft_inputs

    w = mask_words(tm.VOCAB)
    bucket = SimpleNamespace(batch_size=3, grammar_nodes=5, grammar_depth=3, mask_words=w)
    free, forced = backend.compile("regex", REGEX), backend.compile("regex", REGEX)
    for tok in _ids("ab1"):
        free.accept(tok)
    for tok in _ids("ab123"):
        forced.accept(tok)
    row = lambda g: SimpleNamespace(req=SimpleNamespace(grammar=g, finished=False), sample=True)  # noqa: E731
    plan = SimpleNamespace(reqs=[row(free), row(None), row(forced)])
    # Row 0's tree: 1 = "2" and 2 = "x" under the root, 3 = "-" under 1, 4 = "f" under 2 ("x" is not allowed).
    drafts = [_ids("2x-f"), _ids("abcd"), _ids("zzzz")]
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]]
    view = np.array([d + p for d, p in zip(drafts, parents)], np.int32)
    packed, masks, forced_seen = draft_inputs(plan, bucket, view)
    assert forced_seen
    replaced, tokens, walk = packed[:3], packed[3:15].reshape(3, 4), packed[15:].reshape(3, 5)
    assert replaced.tolist() == [0, 0, 1]
    assert walk.tolist() == [[1, 1, 2, 1, 0], [1] * 5, [1, 1, 1, 1, 0]]  # 2: forbidden, tried and rejected
    for node, text in ((0, "ab1"), (1, "ab12"), (3, "ab12-")):
        np.testing.assert_array_equal(masks[0, node], _mask_after(backend, text))
    assert (masks[1] == -1).all()
    assert tokens[2, :3].tolist() == _ids("-fi")  # the forced run, as deep as the step reaches
    for node, text in enumerate(("ab123", "ab123-", "ab123-f", "ab123-fi")):
        np.testing.assert_array_equal(masks[2, node], _mask_after(backend, text))
    np.testing.assert_array_equal(_mask_after(backend, "ab1"), (lambda r: (free.fill(r), r)[1])(np.zeros(w, np.int32)))
    piped, piped_masks, forced_seen = draft_inputs(plan, bucket, view, replace=False)
    assert forced_seen and piped[:3].tolist() == [0, 0, 0] and (piped[3:15] == 0).all()
    assert piped[15:].reshape(3, 5).tolist() == [[1, 1, 2, 1, 0], [1] * 5, [1, 2, 0, 0, 0]]  # "z" is not "-"
    np.testing.assert_array_equal(piped_masks[:2], masks[:2])
    np.testing.assert_array_equal(piped_masks[2, 0], _mask_after(backend, "ab123"))
    assert not draft_inputs(SimpleNamespace(reqs=[row(free), row(None), row(None)]), bucket, view)[2]


def test_rows_walked_at_once_equal_the_walk_token_by_token(backend, monkeypatch):
    """draft_inputs fills every chain row's masks (and every forced run's) in one llguidance call on
    its threads; the decisions and masks equal each row walked on its own, over random drafts that
    the grammar takes, refuses part way, or runs past its end (EOS drafted after the grammar stopped:
    such a row is walked again token by token), beside a tree row and an unconstrained one; every
    matcher ends where it began."""
    from types import SimpleNamespace

    from jspec.runtime import grammar as grammar_mod

    walks, walked_again = [], False  # _walk_tree calls on chains: whether each was one
    walk_tree = grammar_mod._walk_tree

    def counted(g, nodes, parents, masks, walk, max_depth):
        walks.append(list(parents[1:]) == list(range(len(parents) - 1)))
        walk_tree(g, nodes, parents, masks, walk, max_depth)

    monkeypatch.setattr(grammar_mod, "_walk_tree", counted)
    rng = np.random.default_rng(3)
    full = _ids("ab123-fixed-tail-xy") + [0] * 4  # then EOS (token 0), past the grammar's end
    bucket = SimpleNamespace(batch_size=6, grammar_nodes=5, grammar_depth=4, mask_words=mask_words(tm.VOCAB))
    chain, tree = [-1, 0, 1, 2, 3], [-1, 0, 0, 1, 2]
    for trial in range(24):
        reqs, view = [], []
        for r in range(bucket.batch_size):
            k = int(rng.integers(0, len(full) - 3))
            g = backend.compile("regex", REGEX)
            for tok in full[:k]:
                assert g.accept(tok)
            drafts = full[k:k + 4]
            if rng.random() < 0.5:  # a draft the grammar refuses, somewhere along the chain
                drafts[int(rng.integers(0, 4))] = int(rng.integers(0, tm.VOCAB))
            reqs.append(SimpleNamespace(req=SimpleNamespace(grammar=None if r == 5 else g, finished=False),
                                        sample=True))
            view.append(drafts + (tree if r == 4 else chain))
        view, plan = np.array(view, np.int32), SimpleNamespace(reqs=reqs)
        states = lambda: [(r.req.grammar.forced(8), _fill(r.req.grammar)) for r in reqs[:5]]  # noqa: E731
        before = states()
        for replace in (True, False):
            walks.clear()
            packed, masks, _ = grammar_mod.draft_inputs(plan, bucket, view, replace=replace)
            walked_again |= any(walks)
            assert _equal(states(), before)
            want_packed, want_masks, _ = grammar_mod.draft_inputs(plan, bucket, view, replace=replace, at_once=False)
            np.testing.assert_array_equal(packed, want_packed, err_msg=f"trial {trial}")
            np.testing.assert_array_equal(masks, want_masks, err_msg=f"trial {trial}")
    assert walked_again  # rows that ran past the grammar's end took the slow path (the tree row is no chain)


def _fill(g) -> np.ndarray:
    row = np.zeros(mask_words(tm.VOCAB), np.int32)
    g.fill(row)
    return row


def _equal(a, b) -> bool:
    return all(fa == fb and np.array_equal(ma, mb) for (fa, ma), (fb, mb) in zip(a, b))


@pytest.mark.parametrize("key,text,needle", [
    ("regex", "a(b", "unclosed group"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", json.dumps({"type": "no-such-type"}), "no-such-type"),
    ("ebnf", 'root ::= missing', "Rule 'missing' not found"),
])
def test_a_grammar_that_does_not_compile_names_its_key(backend, key, text, needle):
    with pytest.raises(InvalidRequestError, match=f"sampling_params.{key}") as e:
        backend.compile(key, text)
    assert needle in str(e.value)


def test_sampling_params_take_one_grammar_key():
    assert SamplingParams(json_schema=SCHEMA).json_schema == json.dumps(SCHEMA)  # a dict is serialised
    with pytest.raises(InvalidRequestError, match="sampling_params.json_schema: only one of"):
        SamplingParams(regex="a", json_schema="{}")
    with pytest.raises(InvalidRequestError, match="sampling_params.regex: must be a non-empty string"):
        SamplingParams(regex=3)
    with pytest.raises(InvalidRequestError, match="sampling_params.min_new_tokens: cannot be combined with regex"):
        SamplingParams(regex="a+", min_new_tokens=2)


def test_acceptance_stopped_at_a_forced_run_draws_the_bonus_from_the_target():
    """limit 1 on a 3-draft chain: the first draft is verified as usual, the second never is, so
    the emitted pair follows p0 x p1 exactly (no residual distribution at node 1)."""
    v, n = 5, 20000
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(1, 4, v)) * 1.5, jnp.float32)
    p = np.asarray(jax.nn.softmax(logits[0], axis=-1), np.float64)
    p /= p.sum(axis=-1, keepdims=True)
    d = jnp.asarray([[2, 2, 2]], jnp.int32)
    sb = sampling.SamplingBatch(*(jnp.asarray([x]) for x in (1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0)),
                                seed=jnp.asarray([0]), step=jnp.asarray([0]))

    def one(i):
        keys = lambda k: jax.random.split(jax.random.fold_in(jax.random.key(i), k), 1)  # noqa: E731
        kept, bonus = accept.chain(logits, d, None, sb, jnp.asarray([False]), keys, sort=False,
                                   limit=jnp.asarray([1]))
        return kept[0], bonus[0]

    kept, bonus = jax.jit(jax.vmap(one))(jnp.arange(n))
    kept, bonus = np.asarray(kept), np.asarray(bonus)
    assert kept.max() <= 1
    first = np.where(kept == 1, 2, bonus)
    assert stats.chisquare(np.bincount(first, minlength=v), p[0] * n).pvalue > 1e-3
    second = bonus[kept == 1]  # after the kept draft: p1 itself, though d2 = 2 was "drafted"
    assert stats.chisquare(np.bincount(second, minlength=v), p[1] * len(second)).pvalue > 1e-3


# --------------------------------------------------------------------------- engine
def test_outputs_follow_regex_json_schema_and_ebnf(engine):
    base = {"max_new_tokens": 48, "temperature": 0}
    outs = engine.generate(input_ids=[_ids("id?"), _ids("go"), _ids("x")],
                           sampling_params=[{**base, "json_schema": json.dumps(SCHEMA)}, {**base, "regex": REGEX},
                                            {**base, "ebnf": 'root ::= "yes" | "no" | "maybe"'}])
    doc, text, word = (o["text"] for o in outs)
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs), [o["meta_info"] for o in outs]
    parsed = json.loads(doc)
    assert set(parsed) == {"id", "tag"} and isinstance(parsed["id"], int) and parsed["tag"] in ("ab", "cd")
    assert re.fullmatch(REGEX, text) and word in ("yes", "no", "maybe")
    free = engine.generate(input_ids=_ids("go"), sampling_params={**base, "max_new_tokens": 12})
    assert not re.fullmatch(REGEX, free["text"])  # the grammar, not the model, made the text match


def test_masks_are_filled_while_the_next_forward_runs(engine, monkeypatch):
    """With overlap, a constrained decode step launches its forward before the loop reads the step
    before it (whose token the grammar must consume before it can give the next mask), and the
    text is that of the loop without overlap on the target split over 2 devices (its split step
    hands the vocabulary-split logits from the forward to the sampling part; that engine runs the
    GPU's start-up warm-up first, every split part on padding rows)."""
    unread, launches, will_read = [], [], watch_reads(engine)  # per queued forward, per launch
    unwrap = [watch_launches(engine, exe, "queue_first", "first", will_read, unread, launches)
              for exe in engine.runner.compiled.values() if isinstance(exe, SplitExecutable)]
    sp = {"max_new_tokens": 24, "temperature": 0, "regex": REGEX}
    try:
        out = engine.generate(input_ids=_ids("go"), sampling_params=sp)
    finally:
        del engine.runner.dispatch
        for undo in unwrap:
            undo()
    assert re.fullmatch(REGEX, out["text"])
    assert len(unread) >= len(out["output_ids"]) - 2 and all(unread), unread  # each launched with the last unread
    # Each launched on the launcher thread, beside the loop's read of the step before it, under the
    # loop's transfer guard. (The output arrives during that read, so the loop may still be
    # launching the last one.)
    assert until(lambda: len(launches) == len(unread)) and all(
        n.startswith("jspec-launch") and read and refused for n, read, refused in launches), launches
    warmed, warm = [], startup_runs.warm_up
    monkeypatch.setenv("JSPEC_WARM_UP", "1")
    monkeypatch.setattr(startup_runs, "warm_up", lambda runner: warmed.append(warm(runner)) or warmed[-1])
    with Engine(engine.model.path, page_size=4, chunked_prefill_size=16, context_length=96, tp_size=2,
                grammar_backend="llguidance", disable_overlap_schedule=True, disable_top_k_top_p=True,  # greedy only
                **SMALL) as v1:
        assert any(isinstance(e, SplitExecutable) for e in v1.runner.compiled.values())
        assert warmed == [len(v1.runner.buckets)]
        assert v1.generate(input_ids=_ids("go"), sampling_params=sp)["output_ids"] == out["output_ids"]


def test_a_constrained_prompt_launches_before_the_step_in_flight_is_read(engine):
    """A constrained request's last prompt chunk samples under the grammar's first mask, which no
    step in flight changes: it launches before the loop reads a step in flight that sampled for
    another constrained request (which the loop reads for that request's next decode step), and
    each text equals that of its request run alone."""
    sp = {"max_new_tokens": 20, "temperature": 0, "regex": REGEX}
    # Prompts no other test sends (the prefix cache would serve them whole): the long one's last
    # chunk is scheduled after the short one has started decoding.
    prompts = [_ids("hi"), _ids("a longer prompt, in three chunks of sixteen.")]
    core, dispatch, seen = engine.core, engine.runner.dispatch, []

    def recorded(plan, between=None):  # per step sampling for a constrained request
        if any(s.sample and s.req.grammar is not None for s in plan.reqs):
            inflight = core.pending is not None and any(s.sample and s.req.grammar is not None
                                                        for s in core.pending.plan.reqs)
            seen.append((plan.mode, inflight, between is not None))
        return dispatch(plan, between=between)

    engine.runner.dispatch = recorded
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=[sp, sp])
    finally:
        del engine.runner.dispatch
    assert [o["output_ids"] for o in outs] == [engine.generate(input_ids=p, sampling_params=sp)["output_ids"]
                                               for p in prompts]
    assert (ForwardMode.EXTEND, True, False) in seen, seen  # launched with a constrained token unread
    assert (ForwardMode.DECODE, True, True) in seen, seen


@pytest.fixture(scope="module")
def ngram_engine(engine):
    """An adaptive NGRAM engine under the grammar backend, overlapped, one request running: its plain
    step and every chain length (1, 2 and 3 drafts) compiled split; each test sets the policy's choice."""
    with Engine(engine.model.path, page_size=4, chunked_prefill_size=16, context_length=96,
                grammar_backend="llguidance", speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                **{**SMALL, "cuda_graph_bs": [1], "speculative_adaptive": True, "disable_top_k_top_p": True}) as eng:
        yield eng


def test_a_speculative_engines_plain_steps_fill_masks_while_the_forward_runs(engine, ngram_engine):
    """A speculative engine's plain steps (the adaptive policy's choice at large batches) also run
    split under a grammar: the target forward launches before the loop reads the step in flight,
    and the constrained text equals the plain engine's."""
    sp = {"max_new_tokens": 24, "temperature": 0, "regex": REGEX}
    want = engine.generate(input_ids=_ids("go"), sampling_params=sp)["output_ids"]
    eng = ngram_engine
    eng.policy.choose = lambda b, n: 0  # plain steps only, as the policy chooses at large batches
    unread, core, kept = [], eng.core, {}
    before = eng.get_server_info()["num_steps"]["spec"]
    for b, exe in eng.runner.compiled.items():
        if isinstance(exe, SplitExecutable) and not b.speculate:
            kept[exe] = exe.first
            exe.first = lambda *a, _f=exe.first: (unread.append(core.pending is not None), _f(*a))[1]
    try:
        out = eng.generate(input_ids=_ids("go"), sampling_params=sp)
    finally:
        for exe, first in kept.items():
            exe.first = first
    info = eng.get_server_info()
    check_no_leaks(eng)
    assert out["output_ids"] == want and re.fullmatch(REGEX, out["text"])
    assert info["num_steps"]["spec"] == before and len(unread) >= len(want) - 2 and all(unread), unread


def test_every_chain_length_of_a_width_shares_one_carry_arena(engine, ngram_engine):
    """The adaptive policy switching chain lengths every step (1, 2, 3 drafts, and a plain step)
    under a grammar: the constrained greedy text equals the plain engine's, and the whole run
    uses one carry arena (`static_carry`): every chain of the width lays it out for the full
    chain, so no switch fills a new one; each chain's verify part reads it at the same addresses."""
    sp = {"max_new_tokens": 28, "temperature": 0, "regex": REGEX}
    want = engine.generate(input_ids=_ids("go"), sampling_params=sp)["output_ids"]
    eng = ngram_engine
    ks = [1, 2, 0, eng.policy.max_drafts]
    ran, seen = [], []
    cycle = iter(ks * 40)
    eng.policy.choose = lambda b, n: ran.append(next(cycle)) or ran[-1]
    shapes, kept = {}, {}  # width -> its chains' arena shapes
    for b, exe in eng.runner.compiled.items():
        if isinstance(exe, SplitExecutable) and exe.static:
            shapes.setdefault(b.batch_size, set()).add(exe._shapes)
            kept[exe] = exe.second
            exe.second = lambda params, buffers, arena, *rest, _s=exe.second, _b=b: (
                seen.append((_b.draft_steps, tuple(sorted((k, a.unsafe_buffer_pointer()) for k, a in arena.items())))),
                _s(params, buffers, arena, *rest))[1]
    fills = eng.get_server_info()["num_carry_arena_fills"]
    try:
        out = eng.generate(input_ids=_ids("go"), sampling_params=sp)
    finally:
        for exe, second in kept.items():
            exe.second = second
    check_no_leaks(eng)
    assert out["output_ids"] == want and re.fullmatch(REGEX, out["text"])
    assert all(len(s) == 1 for s in shapes.values()), shapes  # each width's chains: the full chain's shapes
    assert {k for k, _ in seen} == {1, 2, 0} and set(ran) == set(ks), (seen, ran)  # 0 in seen: the full chain
    assert len({where for _, where in seen}) == 1, seen
    assert eng.get_server_info()["num_carry_arena_fills"] - fills <= 1  # at most the first step's


def test_the_start_up_warm_up_runs_every_split_part_and_changes_no_answer(engine, ngram_engine, monkeypatch):
    """`startup_runs.warm_up` (on GPUs, at start-up) runs each bucket once on padding rows, a split
    step part by part. Run on engines that have served, it leaves the next constrained and free
    answers as they were (no cached page, slot or carry arena disturbed)."""
    asks = (("go", {"max_new_tokens": 20, "temperature": 0, "regex": REGEX}),
            ("ab", {"max_new_tokens": 12, "temperature": 0}))
    ran, warm = [], SplitExecutable.warm_up
    monkeypatch.setattr(SplitExecutable, "warm_up", lambda self, *a: ran.append(self.bucket) or warm(self, *a))
    ngram_engine.policy.choose = lambda b, n: ngram_engine.policy.max_drafts
    for eng in (engine, ngram_engine):
        before = [eng.generate(input_ids=_ids(p), sampling_params=sp)["output_ids"] for p, sp in asks]
        assert eng.wait_idle(30)
        ran.clear()
        assert startup_runs.warm_up(eng.runner) == len(eng.runner.buckets)
        assert set(ran) == {b for b in eng.runner.buckets if b.grammar_split} != set()
        assert [eng.generate(input_ids=_ids(p), sampling_params=sp)["output_ids"] for p, sp in asks] == before
        check_no_leaks(eng)


def test_parts_run_as_two_copies_launch_them_in_turn_and_change_no_answer(engine, ngram_engine):
    """On a GPU a pipelined step's forward part runs as two loaded copies taken in turn
    (`part_copies`), so that each copy's graph keeps the scratch address it sees; any part may
    (`JSPEC_GRAMMAR_PART_COPIES`). Built here as a GPU engine builds them, for all three parts (a
    CPU engine does not: nothing is captured there): each part's copies are two executables of one
    program, launched alternately, the forward's on the launcher thread and the others on the
    loop's; the constrained greedy text equals the plain engine's; the start-up warm-up runs the
    step once per copy, each copy once, in order."""
    from jspec.runtime import part_copies

    sp = {"max_new_tokens": 24, "temperature": 0, "regex": REGEX}
    want = engine.generate(input_ids=_ids("go"), sampling_params=sp)["output_ids"]
    eng = ngram_engine
    eng.policy.choose = lambda b, n: eng.policy.max_drafts  # the full chain: its buckets get the copies
    runner, kept, launched = eng.runner, {}, []
    names = ("first", "forward", "second")
    for b, exe in list(runner.compiled.items()):
        if isinstance(exe, SplitExecutable) and exe.forward is not None and not b.draft_steps:
            copies = {n: part_copies.load_copy(getattr(exe, n), runner.mesh.devices.flat) for n in names}
            doubled = SplitExecutable([exe.first, exe.forward, exe.second, exe.fused], b, exe.sharding, plain=False,
                                      guard=exe.guard, arenas=runner.arenas, copies=copies)
            for n in names:
                alt = getattr(doubled, n)
                assert alt.copies == (getattr(exe, n), copies[n]) and alt.plan is getattr(exe, n).plan
                assert copies[n].compiled is not getattr(exe, n).compiled
                alt.copies = tuple(
                    lambda *a, _c=c, _i=i, _b=b, _n=n: (launched.append((_b, _n, _i, threading.current_thread().name)),
                                                        _c(*a))[1]
                    for i, c in enumerate(alt.copies))
            kept[b], runner.compiled[b] = exe, doubled
    assert len(kept) == 2  # the full chain at both widths
    try:
        out = eng.generate(input_ids=_ids("go"), sampling_params=sp)
        for n in names:
            steps = [i for _, m, i, _ in launched if m == n]
            threads = {t for _, m, _, t in launched if m == n}
            assert len(threads) == 1 and ("jspec-launch_0" in threads) == (n == "forward"), (n, threads)
            assert len(steps) >= 4 and steps == [k % 2 for k in range(len(steps))], (n, steps)
        assert eng.wait_idle(30)
        launched.clear()
        startup_runs.warm_up(runner)
        warmed = list(dict.fromkeys(b for b, *_ in launched))  # the buckets in their warm-up order
        assert set(warmed) == set(kept)
        for b in warmed:  # the whole step twice; each part's copies once each (from where serving left them)
            runs = [(n, i) for c, n, i, _ in launched if c == b]
            assert [n for n, _ in runs] == list(names) * 2, runs
            assert all(sorted(i for m, i in runs if m == n) == [0, 1] for n in names), runs
    finally:
        runner.compiled.update(kept)
    check_no_leaks(eng)
    assert out["output_ids"] == want and re.fullmatch(REGEX, out["text"])


def test_a_plain_engines_split_parts_run_as_two_copies(engine):
    """A plain grammar engine's split decode step (the forward on the launcher thread, then sampling
    with the masks) with both parts as two copies (`JSPEC_GRAMMAR_PART_COPIES=draft,verify` on a
    GPU): each part's copies taken in turn, the constrained greedy text unchanged."""
    from jspec.runtime import part_copies

    sp = {"max_new_tokens": 24, "temperature": 0, "regex": REGEX}
    want = engine.generate(input_ids=_ids("so"), sampling_params=sp)["output_ids"]
    assert engine.wait_idle(30)
    runner, kept, launched = engine.runner, {}, []
    for b, exe in list(runner.compiled.items()):
        if isinstance(exe, SplitExecutable) and not b.sort:  # greedy rows; XLA:CPU cannot serialize a sort
            copies = {n: part_copies.load_copy(getattr(exe, n), runner.mesh.devices.flat) for n in ("first", "second")}
            doubled = SplitExecutable([exe.first, exe.second, exe.fused], b, exe.sharding, plain=True, guard=exe.guard,
                                      copies=copies)
            for n in copies:
                alt = getattr(doubled, n)
                alt.copies = tuple(lambda *a, _c=c, _i=i, _n=n: (launched.append((_n, _i)), _c(*a))[1]
                                   for i, c in enumerate(alt.copies))
            kept[b], runner.compiled[b] = exe, doubled
    assert kept
    try:
        out = engine.generate(input_ids=_ids("so"), sampling_params=sp)
    finally:
        runner.compiled.update(kept)
    for n in ("first", "second"):
        steps = [i for m, i in launched if m == n]
        assert len(steps) >= 4 and steps == [k % 2 for k in range(len(steps))], (n, steps)
    check_no_leaks(engine)
    assert out["output_ids"] == want and re.fullmatch(REGEX, out["text"])


def test_split_parts_take_only_the_arrays_they_read(ngram_engine):
    """Each part of a speculative split step is compiled on the arrays it reads (`slim_part`): the
    draft part takes none of the target's KV pools (it hands them back as they came, neither
    donated nor copied) and far fewer arrays than it is called with; the forward part writes the
    pools and takes them donated."""
    eng = ngram_engine
    num_params = len(eng.runner.params)
    pools = range(num_params, num_params + len(jax.tree.leaves(eng.runner.state.caches)))  # the state's first field
    split = [exe for b, exe in eng.runner.compiled.items() if isinstance(exe, SplitExecutable) and exe.forward]
    assert split
    for exe in split:
        draft, forward = exe.first.plan, exe.forward.plan
        taken = set(draft.read) | set(draft.donated)
        assert not taken & set(pools) and {i for _, i in draft.passed} >= set(pools)
        assert len(taken) < len(draft.in_avals) // 2
        assert set(pools) <= set(forward.donated)


def test_the_engine_is_not_idle_while_a_step_that_read_the_last_one_is_dispatched(engine, ngram_engine, monkeypatch):
    """A constrained step reads the step in flight between its parts (`between`), which may finish
    the last request while the runner does not hold the device state yet (the first part took it
    and the rest is still to launch): `wait_idle` must not return there, so the loop reports work
    until the dispatch is over, and the device state is whole once it returns."""
    seen, complete = [], SplitExecutable.complete
    for eng in (engine, ngram_engine):
        monkeypatch.setattr(SplitExecutable, "complete",
                            lambda self, *a, _core=eng.core: (seen.append(_core.has_work()), complete(self, *a))[1])
        if eng is ngram_engine:
            eng.policy.choose = lambda b, n: eng.policy.max_drafts
        sp = {"max_new_tokens": 24, "temperature": 0, "regex": REGEX}
        for _ in range(3):
            assert re.fullmatch(REGEX, eng.generate(input_ids=_ids("go"), sampling_params=sp)["text"])
            assert eng.wait_idle(30)
            assert not [x for x in jax.tree.leaves(eng.runner.state) if x.is_deleted()]
        assert seen and all(seen), seen
        seen.clear()
        check_no_leaks(eng)


def test_a_read_that_fails_between_the_parts_leaves_the_engine_serving(engine):
    """The previous step is read between a split step's parts, after the first part took the device
    state: when that read raises, the step still completes, the requests fail with the error named,
    and the next constrained request is exact again."""
    sp = {"max_new_tokens": 16, "temperature": 0, "regex": REGEX}
    want = engine.generate(input_ids=_ids("go"), sampling_params=sp)
    core = engine.core

    def boom():
        del core._read_pending  # once
        raise RuntimeError("reading failed")

    core._read_pending = boom
    failed = engine.generate(input_ids=_ids("go"), sampling_params=sp)
    assert failed["meta_info"]["finish_reason"]["type"] == "abort", failed["meta_info"]
    assert "reading failed" in failed["meta_info"]["finish_reason"]["message"]
    assert engine.generate(input_ids=_ids("go"), sampling_params=sp)["output_ids"] == want["output_ids"]
    engine._error = None
    check_no_leaks(engine)


def test_sampled_parallel_and_streamed_requests_follow_the_grammar(engine):
    sp = {"max_new_tokens": 40, "temperature": 1.0, "regex": REGEX}
    outs = engine.generate(input_ids=[_ids("a"), _ids("b")], sampling_params=[{**sp, "n": 3, "seed": 4}, sp])
    assert len(outs) == 4 and all(re.fullmatch(REGEX, o["text"]) for o in outs)
    assert len({o["text"] for o in outs[:3]}) > 1  # three samples, not one copied
    pieces = list(engine.generate(input_ids=_ids("a"), sampling_params={**sp, "seed": 4}, stream=True))
    assert "".join(p["text"] for p in pieces) == outs[0]["text"]
    check_no_leaks(engine)


def test_a_bad_grammar_is_refused_and_the_engine_keeps_serving(engine):
    with pytest.raises(InvalidRequestError, match="sampling_params.regex"):
        engine.generate(input_ids=_ids("a"), sampling_params={"max_new_tokens": 4, "regex": "a(b"})
    out = engine.generate(input_ids=_ids("a"), sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                               "regex": "[xyz]+"})
    assert re.fullmatch("[xyz]+", out["text"])


def test_constrained_requests_compile_nothing_after_warm_up(engine):
    with compilations() as seen:
        engine.generate(input_ids=[_ids("q"), _ids("r")],
                        sampling_params=[{"max_new_tokens": 10, "temperature": 0, "regex": REGEX},
                                         {"max_new_tokens": 10, "temperature": 0}])
    assert seen == []


def test_structured_output_needs_a_backend(engine):
    from jspec.runtime.request import RequestLimits, make_request

    limits = RequestLimits(vocab_size=tm.VOCAB, context_length=512, pool_tokens=1024, spec_extra=0, max_top_logprobs=0,
                           disable_top_k_top_p=False)
    with pytest.raises(InvalidRequestError, match="sampling_params.regex: structured output is off"):
        make_request(limits, None, prompt=None, input_ids=[1], sampling_params={"regex": "a"}, return_logprob=False,
                     top_logprobs_num=0, stream=False, rid=None, next_seed=lambda: 0)
    with pytest.raises(ConfigError, match="grammar_backend must be one of"):
        Engine(engine.model.path, grammar_backend="xgrammar", **SMALL)


def test_eagle3_drafts_under_a_grammar_equal_the_plain_engine_and_are_accepted():
    """The shipped tiny Qwen3 + EAGLE3 on the target split over 2 devices, greedy under a JSON
    schema and a regex: the same text as the unsplit plain engine, in far fewer verify steps than
    tokens (forced runs and the drafter's own proposals, each checked against the grammar along its
    path; the split step carries the split pools between its parts). Unsplit, every drafter:
    tests/jspec/speculative/test_spec_penalties_logprobs.py."""
    from jspec.tiny import tiny_dir

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                               "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    sp = [{"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(schema)},
          {"max_new_tokens": 30, "temperature": 0, "regex": r"(yes|no), because [a-z ]{5,20}\."}]
    prompts = ["Tell me about a person.", "Is the sky blue?"]
    settings = dict(grammar_backend="llguidance", dtype="float32", cuda_graph_bs=[4], max_running_requests=4,
                    chunked_prefill_size=64, prefill_token_buckets=[64], context_length=256, disable_top_k_top_p=True,
                    show_progress=False, compilation_cache_dir="none")
    with Engine(tiny_dir("qwen3"), **settings) as eng:
        want = eng.generate(prompt=prompts, sampling_params=sp)
    with Engine(tiny_dir("qwen3"), speculative_algorithm="EAGLE3", speculative_draft_model_path=tiny_dir("qwen3-eagle3"),
                speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                speculative_adaptive=False, tp_size=2, **settings) as eng:
        got = eng.generate(prompt=prompts, sampling_params=sp)
        check_no_leaks(eng)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    json.loads(got[0]["text"])
    assert re.fullmatch(r"(yes|no), because [a-z ]{5,20}\.", got[1]["text"])
    tokens = sum(len(g["output_ids"]) for g in got)
    assert sum(g["meta_info"]["spec_verify_ct"] for g in got) <= 0.6 * tokens


def test_tried_and_forbidden_nodes_bound_real_and_simulated_acceptance():
    """A forbidden draft (walk 2) is tried by real acceptance, which the masked target makes reject
    it, but never kept by a simulated one (speculative_simulate_accept_length keeps drafts blindly,
    so a forbidden one would reach the grammar and end the request)."""
    from jspec.speculative import grammar_nodes

    walk = jnp.asarray([[1, 1, 2, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert grammar_nodes.chain_limit(walk).tolist() == [2, 3, 0]
    assert grammar_nodes.chain_limit(walk, allowed_only=True).tolist() == [1, 3, 0]
    parents = jnp.asarray([[-1, 0, 1, 2]] * 3)
    assert grammar_nodes.walk_parents(parents, walk).tolist() == [[-1, 0, 1, -2], [-1, 0, 1, 2], [-1, -2, -2, -2]]
    path = jnp.asarray([[0, 1, 2, 2], [0, 1, 2, 3], [0, 0, 0, 0]])  # a first-child path, repeating at a leaf
    assert grammar_nodes.path_limit(walk, path).tolist() == [1, 3, 0]
