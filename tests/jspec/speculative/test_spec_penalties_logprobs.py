"""Penalties, logit bias, logprobs and structured output under speculation, every drafter family:
greedy output with repetition, frequency and presence penalties and a logit bias equals the plain
engine's greedy output under them (a draft node is verified against the distribution it would have
had its earlier drafts been accepted), the reported logprobs and top logprobs of every emitted token
equal the plain engine's, and greedy output under a regex and a JSON schema matches them and equals
the plain engine's constrained output (chains and trees accept the grammar's forced runs).
Overlapped (v2) and synchronous (v1) engines alternate across the families; their device steps are
the same. The split steps of every case but one (`LOOSE_CARRY`) hand their carry between the parts
in static buffers, whose device addresses must stay the same from step to step.
The penalised node distributions themselves: tests/jspec/speculative/test_penalise_nodes.py;
grammar parts and the plain engine: tests/jspec/runtime/test_grammar.py."""

from __future__ import annotations

import itertools
import json
import re
import numpy as np
import pytest

from jspec import Engine
from jspec.runtime.compile_options import STATIC_CARRY_ENV
from jspec.runtime.split_step import SplitExecutable
from tests.support import models as tm
from tests.support.engines import SPEC_BS4, check_no_leaks, output_ids, until, watch_launches, watch_reads
from tests.support.spec_eagle import build_models, case_kwargs

PS = 4
PROMPTS = [tm.random_ids(7, seed=41) * 2 + tm.random_ids(n, seed=800 + n) for n in (3, 6, 1)]
BASE = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
# One request per setting, in one batch: no penalty, then each penalty alone, then all three.
# min_new_tokens: eight stop tokens (ones the targets' free greedy outputs start with), held back for
# the first MIN_NEW tokens (a node's own output index decides, along the draft path), then the first
# one drawn ends the request.
STOPS, MIN_NEW = [13, 34, 43, 47, 52, 78, 79, 96], 5
# A logit bias (after a repetition penalty): every even token banned, three odd ones favoured.
BANNED = set(range(0, tm.VOCAB, 2))
BIAS = {**{str(t): -100.0 for t in BANNED}, "3": 2.0, "11": 1.5, "29": -0.5}
SAMPLING = [BASE, {**BASE, "repetition_penalty": 3.0}, {**BASE, "frequency_penalty": 2.0},
            {**BASE, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 2.0},
            {**BASE, "ignore_eos": False, "stop_token_ids": STOPS, "min_new_tokens": MIN_NEW},
            {**BASE, "repetition_penalty": 1.5, "logit_bias": BIAS}]
HELD = 4  # SAMPLING's min_new_tokens setting
TOP = 3
# Structured output (a byte-level tokenizer of the tiny vocabulary, tokenizer_path): after the digits
# the grammar forces a 12-character run, which chain drafters verify in one step.
REGEX = r"ab[0-9]{1,3}-fixed-tail-[a-z]{2}"
SCHEMA = json.dumps({"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "tag": {"type": "string", "enum": ["alpha", "beta"]}},
                     "required": ["id", "tag"], "additionalProperties": False,
                     "x-guidance": {"whitespace_flexible": False}})
GBASE = {"max_new_tokens": 28, "temperature": 0}
GRAMMAR = [{**GBASE, "regex": REGEX}, {**GBASE, "json_schema": SCHEMA}, {**GBASE, "ignore_eos": True}]

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

# Cases run with JSPEC_GRAMMAR_STATIC_CARRY=0: their split steps hand the carry between the parts as
# separate arrays (the default where every part runs uncaptured); the others keep it in static buffers.
LOOSE_CARRY = {"ngram-v2"}
# Cases with two decode buckets: as constrained rows finish, the batch moves to the narrower one,
# whose first step drops the wider one's arena and fills its own (one arena lives at a time).
TWO_BUCKETS = {"eagle3-v2"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_checkpoint):
    d = build_models(tmp_path_factory.mktemp("spec_penalties"), ("qwen3", "eagle3", "bigram", "agree_eagle", "block_bigram",
                                                      "agree_dflash", "bigram_next"), tiny_checkpoint)
    d["llama"] = tiny_checkpoint("llama", 42)  # STANDALONE's draft: another architecture, same vocabulary
    tok = tmp_path_factory.mktemp("char_tokenizer")
    tm.char_tokenizer().save(str(tok / "tokenizer.json"))
    d["tokenizer"] = str(tok)
    return d


def _engine(dirs, target, **kw):
    return Engine(dirs[target], page_size=PS, disable_radix_cache=True, grammar_backend="llguidance",
                  tokenizer_path=dirs["tokenizer"], **{**SPEC_BS4, **kw})


def _split_parts_run(eng, forwards: list | None = None, launches: list | None = None) -> list[int]:
    """Records each first part (drafts, or a plain step's forward) that split steps launch: whether
    the step before it was still unread then (overlap: the host fills grammar inputs meanwhile);
    and in `forwards`, the same for each target forward a pipelined step queues as a part of its
    own (unread: queued behind the drafts before the walk; read: after a walk that replaced drafts).
    In `launches`, per forward launch: its thread, and whether a launch queued before the loop reads
    the last step saw that read happen while it waited to start (it would wait forever were the
    launch on the loop's thread)."""
    runs, will_read = [], watch_reads(eng)
    for exe in eng.runner.compiled.values():
        if isinstance(exe, SplitExecutable):
            def counted(*a, _first=exe.first):
                runs.append(eng.core.pending is not None)
                return _first(*a)
            exe.first = counted
            if exe.forward is not None and forwards is not None:
                watch_launches(eng, exe, "queue_forward", "forward", will_read, forwards, launches)
    return runs


def _watch_arenas(eng) -> list:
    """Records, in launch order, each verify part's bucket and the device addresses of the carry
    arena it reads (`jspec.runtime.static_carry`; nothing for a step whose carry is not static)."""
    seen = []
    for exe in eng.runner.compiled.values():
        if isinstance(exe, SplitExecutable) and exe.static:
            def verify(params, buffers, arena, *rest, _second=exe.second, _bucket=exe.bucket):
                seen.append((_bucket, tuple(sorted((k, a.unsafe_buffer_pointer()) for k, a in arena.items()))))
                return _second(params, buffers, arena, *rest)
            exe.second = verify
    return seen


def _run(eng, static: bool = True, buckets: int = 1):
    """Every request with penalties and logprobs, then the constrained ones; static: a speculative
    engine's split steps must carry in static buffers (their default); buckets: how many decode
    buckets' split steps must have run constrained."""
    forwards, launches = [], []
    split_runs = _split_parts_run(eng, forwards, launches)
    arenas = _watch_arenas(eng)
    outs = eng.generate(input_ids=[p for p in PROMPTS for _ in SAMPLING], sampling_params=SAMPLING * len(PROMPTS),
                        return_logprob=True, top_logprobs_num=TOP)
    # No row is constrained: every step ran fused, never in parts.
    assert not split_runs
    # Constrained rows beside a free one, so a batch mixes rows that accept drafts and rows that
    # accept forced runs only.
    constrained = eng.generate(input_ids=PROMPTS[:1] * len(GRAMMAR), sampling_params=GRAMMAR)
    assert split_runs  # constrained rows ran split
    if eng.spec is not None and static:
        # Speculative split steps hand their carry between the parts in static buffers: the same
        # device addresses from step to step of a bucket, so their captured graphs need no
        # re-recording (a step of another bucket in between replaces the arena).
        runs = [[where for _, where in run] for _, run in itertools.groupby(arenas, key=lambda seen: seen[0])]
        assert any(len(run) > 1 for run in runs) and all(len(set(run)) == 1 for run in runs), arenas
        assert len({bucket for bucket, _ in arenas}) == buckets, arenas
    elif eng.spec is not None:
        assert not arenas
    assert any(split_runs) == eng.core.overlap  # with overlap, first parts launch before the last step is read
    if eng.spec is not None:
        # With overlap a speculative step is pipelined: its forward is queued behind the drafts
        # while the last step is unread, except after a walk that met a forced run ("-fixed-tail-"),
        # when it waits for the walk and verifies the run; without overlap it is not a part of its own.
        assert (True in forwards and False in forwards) if eng.core.overlap else not forwards, forwards
        # Each forward launches on the launcher thread, beside the loop's read of the last step.
        # (The output arrives during that read, so the loop may still be launching the last one.)
        # They run under the loop's transfer guard ("disallow" for v2 here: no implicit transfer).
        guarded = eng.engine_config.transfer_guard == "disallow"
        assert until(lambda: len(launches) == len(forwards)) and all(
            name.startswith("jspec-launch") and read and refused == guarded for name, read, refused in launches), launches
    return outs, constrained


@pytest.fixture(scope="module")
def plain(dirs):
    """The plain engine's outputs per target (same settings, the prefix cache off on both sides)."""
    got = {}

    def get(target):
        if target not in got:
            with _engine(dirs, target) as eng:
                got[target] = _run(eng)
        return got[target]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_penalties_logprobs_and_grammars_equal_the_plain_engine(dirs, plain, case, monkeypatch):
    target = CASES[case][1]
    want, want_g = plain(target)
    if case in LOOSE_CARRY:  # the carry as separate arrays, as steps whose parts all run uncaptured hand it
        monkeypatch.setenv(STATIC_CARRY_ENV, "0")
    two = {"cuda_graph_bs": [2, 4]} if case in TWO_BUCKETS else {}
    with _engine(dirs, target, **case_kwargs(dirs, CASES[case]), **two) as eng:
        got, got_g = _run(eng, static=case not in LOOSE_CARRY, buckets=2 if two else 1)
        assert output_ids(got) == output_ids(want)
        assert output_ids(got_g) == output_ids(want_g)
        assert re.fullmatch(REGEX, got_g[0]["text"]), got_g[0]["text"]
        doc = json.loads(got_g[1]["text"])
        assert set(doc) == {"id", "tag"} and doc["tag"] in ("alpha", "beta"), doc
        # The forced run "-fixed-tail-" (12 tokens) goes by in steps of up to num_steps + 1 tokens
        # (a tree's as a chain hanging off its root).
        verifies = got_g[0]["meta_info"]["spec_verify_ct"]
        assert verifies <= len(got_g[0]["output_ids"]) - 8, (verifies, got_g[0]["output_ids"])
        # The penalties change what is generated, so the drafts are verified against them.
        ids = output_ids(want)
        held = ids[HELD::len(SAMPLING)]
        assert all(len(h) >= MIN_NEW and not set(h[:MIN_NEW]) & set(STOPS) for h in held), held
        assert any(set(b[:MIN_NEW]) & set(STOPS) for b in ids[::len(SAMPLING)])  # the hold changed something
        assert all(len(h) == BASE["max_new_tokens"] or h[-1] in STOPS for h in held)  # a stop ends it after that
        assert any(ids[i] != ids[i + k] for i in range(0, len(ids), len(SAMPLING)) for k in range(1, len(SAMPLING)))
        biased = ids[len(SAMPLING) - 1::len(SAMPLING)]
        assert not any(set(b) & BANNED for b in biased), biased  # a -100 bias: never drawn
        assert any(set(b) & BANNED for b in ids[::len(SAMPLING)])  # ... where the free greedy output draws them
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

