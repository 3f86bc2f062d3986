"""Engine end to end on CPU: sampling reproducibility, stop conditions, streaming, logprobs, errors,
no implicit transfers in the loop, zero recompilation, and a stress run with retraction and aborts
that must leave no page or slot behind. Greedy parity with transformers: test_engine_parity.py (a
second file, so that `-n 2 --dist loadfile` runs the two side by side)."""

from __future__ import annotations

import os
import random
import re
import threading
import time

import jax
import numpy as np
import pytest

from jspec import Engine
from jspec.errors import ConfigError, InvalidRequestError
from tests.support import models as tm
from tests.support.compiles import compilations
from tests.support.engines import SMALL, check_no_leaks


def add_word_tokenizer(d: str) -> None:
    """tokenizer.json whose token i is the word `w{i}`: decoded text is `w3 w17 ...`."""
    from tokenizers import decoders

    tok = tm.word_tokenizer({f"w{i}": i for i in range(tm.VOCAB)}, unk="w0")
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(os.path.join(d, "tokenizer.json"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("eng_qwen3"))
    hf = tm.build("qwen3", d, seed=21)
    add_word_tokenizer(d)
    return d, hf


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    """The module's engine. Its loop runs under jax.transfer_guard("disallow"), so every test that
    uses it also checks that serving its requests (sampling with top-k / top-p, penalties, stops,
    streaming, logprobs, refused requests) makes no implicit device-host transfer: such a transfer
    would raise in the loop and fail the request (test_loop_makes_no_implicit_transfers)."""
    eng = Engine(qwen3_dir[0], page_size=4, chunked_prefill_size=16, context_length=128, transfer_guard="disallow",
                 **SMALL)
    yield eng
    eng.shutdown()


# --------------------------------------------------------------------------- sampling
def test_seeded_sampling_reproducible_and_batch_independent(engine):
    sp = {"max_new_tokens": 8, "temperature": 1.3, "top_p": 0.9, "top_k": 50, "seed": 1234, "ignore_eos": True}
    p = tm.random_ids(7, seed=99)
    alone = engine.generate(input_ids=p, sampling_params=sp)["output_ids"]
    others = [tm.random_ids(n, seed=n + 1) for n in (3, 12, 5)]
    mixed = engine.generate(input_ids=others[:2] + [p] + others[2:],
                            sampling_params=[dict(sp, seed=7), dict(sp, seed=8), sp, dict(sp, seed=9)])
    assert mixed[2]["output_ids"] == alone
    again = engine.generate(input_ids=p, sampling_params=sp)["output_ids"]
    assert again == alone
    different = engine.generate(input_ids=p, sampling_params=dict(sp, seed=4321))["output_ids"]
    assert different != alone  # 8 tokens at temperature 1.3 from a 97-token vocabulary


def test_penalties_change_output(engine):
    p = tm.random_ids(6, seed=5)
    base = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True})["output_ids"]
    pen = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                        "frequency_penalty": 2.0, "repetition_penalty": 1.8}
                          )["output_ids"]
    assert len(set(pen)) > len(set(base)) or pen != base


def test_logit_bias_stays_with_its_request(engine):
    """A request's logit bias reaches every token it samples (its first, from the prompt step, and
    the decode steps') and no other request: beside it and afterwards in the same slots, unbiased
    requests generate what they generate alone."""
    p = tm.random_ids(6, seed=6)
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    base = engine.generate(input_ids=p, sampling_params=greedy)["output_ids"]
    ban = {str(t): -100.0 for t in base}
    outs = engine.generate(input_ids=[p] * 4, sampling_params=[{**greedy, "logit_bias": ban}, greedy,
                                                               {**greedy, "logit_bias": {"7": 100.0}}, greedy])
    assert not set(outs[0]["output_ids"]) & set(base)
    assert outs[2]["output_ids"] == [7] * 10
    assert outs[1]["output_ids"] == outs[3]["output_ids"] == base
    # The slots the biased requests held, reused by unbiased ones.
    assert all(o["output_ids"] == base for o in engine.generate(input_ids=[p] * 4, sampling_params=greedy))


# --------------------------------------------------------------------------- stops, stream, logprobs
def test_stop_token_ids_and_eos(engine):
    p = tm.random_ids(9, seed=3)
    free = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    ids = free["output_ids"]
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    out = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                        "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}


def test_min_new_tokens_holds_stops_back_then_lets_them_end(engine):
    """SGLang's min_new_tokens: the stop token cannot be drawn before it (the device masks it), a
    stop string completed before it does not count, and the first stop token drawn after it ends
    the request."""
    p = tm.random_ids(9, seed=4)  # a prompt whose held-back first choice comes back soon after
    free = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    ids = free["output_ids"]
    stop_tok = ids[0]  # the model's first choice: wanted at once, held back for four tokens
    held = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                         "stop_token_ids": [stop_tok], "min_new_tokens": 4})
    out = held["output_ids"]
    assert stop_tok not in out[:4] and out[0] != ids[0]
    assert held["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok} and out[-1] == stop_tok
    assert len(out) > 4
    word = free["text"].split()[1]  # completed by the second token: ignored until four are out
    late = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 16, "temperature": 0, "stop": [word],
                                                         "min_new_tokens": 4, "ignore_eos": True})
    assert len(late["output_ids"]) >= 4 and late["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}


def test_stop_string_trims_text(engine):
    p = tm.random_ids(9, seed=3)
    free = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    words = free["text"].split()
    assert len(words) == 10
    stop = words[5]
    out = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 10, "temperature": 0, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"].split()
    assert free["text"].startswith(out["text"].rstrip())
    # SGLang's no_stop_trim: the same tokens, the stop string kept at the end of the text.
    kept = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 10, "temperature": 0, "stop": [stop],
                                                         "no_stop_trim": True})
    assert kept["output_ids"] == out["output_ids"] and kept["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                            "matched": stop}
    assert kept["text"].split() == words[:words.index(stop) + 1] and free["text"].startswith(kept["text"])


def test_stop_regex_trims_text_and_streams(engine):
    """SGLang's stop_regex: the request stops at the first token after which its text holds a
    match, cut before the match; streamed, the pieces add up to that text, a bounded pattern's
    arriving as the output grows (only its longest match's worth is held back), an unbounded
    one's at the end."""
    p = tm.random_ids(9, seed=3)
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    free = engine.generate(input_ids=p, sampling_params=sp)
    word = free["text"].split()[6]
    for pattern, bounded in ((rf"{word}\b", True), (rf"{word}[0-9]*", False)):
        m = re.search(pattern, free["text"])
        out = engine.generate(input_ids=p, sampling_params={**sp, "stop_regex": pattern})
        assert out["text"] == free["text"][:m.start()] and out["output_ids"] == free["output_ids"][:len(out["output_ids"])]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
        pieces = list(engine.generate(input_ids=p, sampling_params={**sp, "stop_regex": pattern}, stream=True))
        assert "".join(c["text"] for c in pieces) == out["text"]
        assert (sum(bool(c["text"]) for c in pieces) > 1) == bounded
        kept = engine.generate(input_ids=p, sampling_params={**sp, "stop_regex": [pattern], "no_stop_trim": True})
        assert kept["output_ids"] == out["output_ids"] and kept["text"].startswith(out["text"] + word)


def test_text_prompt_and_streaming(engine):
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = engine.generate(prompt="w1 w2 w3 w4", sampling_params=sp)
    pieces = list(engine.generate(prompt="w1 w2 w3 w4", sampling_params=sp, stream=True))
    assert sum(len(p["output_ids"]) for p in pieces) == 6
    assert [t for p in pieces for t in p["output_ids"]] == full["output_ids"]
    assert "".join(p["text"] for p in pieces) == full["text"]
    assert pieces[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_asyncio_stream_gives_the_threaded_streams_chunks(engine, monkeypatch):
    """generate_stream_async: the engine loop wakes the event loop itself (no reader thread); the
    chunks carry the same tokens and text as the blocking stream, a bad request raises at the call,
    and a stream left early is aborted like any other (its pages come back)."""
    import asyncio

    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = engine.generate(prompt="w1 w2 w3 w4", sampling_params=sp)
    aborted, real_abort = [], engine.abort
    monkeypatch.setattr(engine, "abort", lambda rid: aborted.append(rid) or real_abort(rid))

    async def run():
        pieces = [c async for c in engine.generate_stream_async(prompt="w1 w2 w3 w4", sampling_params=sp)]
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            engine.generate_stream_async(input_ids=[1, 2], sampling_params={"max_new_tokens": -1})
        long = engine.generate_stream_async(input_ids=[1, 2, 3], rid="left-early",
                                            sampling_params={"max_new_tokens": 100, "ignore_eos": True})
        first = await anext(long)
        engine.abort("left-early")
        rest = [c async for c in long]
        closed = engine.generate_stream_async(input_ids=[4, 5, 6], rid="closed", sampling_params={
            "max_new_tokens": 100, "ignore_eos": True})
        await anext(closed)
        await closed.aclose()  # a reader that leaves: its request is aborted, not run to the end
        # Submitted and never read: the loop below ends first, and the engine keeps serving.
        engine.generate_stream_async(input_ids=[7, 8], sampling_params={"max_new_tokens": 12, "ignore_eos": True})
        return pieces, first, rest

    pieces, first, rest = asyncio.run(asyncio.wait_for(run(), 60))
    assert [t for p in pieces for t in p["output_ids"]] == full["output_ids"]
    assert "".join(p["text"] for p in pieces) == full["text"]
    assert pieces[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert first["output_ids"] and rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.wait_idle(timeout=30)
    assert aborted == ["left-early", "closed"]
    assert engine.generate(prompt="w1 w2 w3 w4", sampling_params=sp)["output_ids"] == full["output_ids"]
    check_no_leaks(engine)


def test_streamed_text_holds_back_a_stop_string_in_the_making(engine):
    """A stop string spanning two tokens ("7 w3" over "w17", "w3"): its first character is the end of
    the first token's text, held back until the stop is decided, so the streamed pieces add up to
    the non-streamed text; only the last chunk carries the finish reason."""
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    words = engine.generate(prompt="w1 w2 w3 w4", sampling_params=sp)["text"].split()
    stop = f"{words[2][-1]} {words[3]}"  # the last character of the third word, then the fourth
    sp["stop"] = [stop]
    full = engine.generate(prompt="w1 w2 w3 w4", sampling_params=sp)
    assert full["meta_info"]["finish_reason"]["matched"] == stop
    pieces = list(engine.generate(prompt="w1 w2 w3 w4", sampling_params=sp, stream=True))
    assert "".join(p["text"] for p in pieces) == full["text"]
    assert [p["meta_info"]["finish_reason"] is None for p in pieces] == [True] * (len(pieces) - 1) + [False]
    # A stop kept in the text (no_stop_trim) is not held back: the pieces add up to that text.
    kept = {**sp, "no_stop_trim": True}
    full = engine.generate(prompt="w1 w2 w3 w4", sampling_params=kept)
    assert full["text"].endswith(stop)
    assert "".join(p["text"] for p in engine.generate(prompt="w1 w2 w3 w4", sampling_params=kept, stream=True)) \
        == full["text"]


def test_logprobs(engine):
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True},
                          return_logprob=True, top_logprobs_num=3)
    lps = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    for (lp, tok, _), top in zip(lps, tops):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy: top-1 is chosen
        assert top[0][0] >= top[1][0] >= top[2][0] and lp <= 0


def test_max_new_tokens_zero(engine):
    out = engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(input_ids=[]), "input_ids"),
        (dict(input_ids=[1, tm.VOCAB]), "input_ids"),
        (dict(input_ids=[1, -1]), "input_ids"),
        (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": 1000}), "max_new_tokens"),
        (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
        (dict(input_ids=[1, 2], sampling_params={"temperature": -0.5}), "temperature"),
        (dict(input_ids=[1, 2], sampling_params={"top_p": 0.0}), "top_p"),
        (dict(input_ids=[1, 2], sampling_params={"top_p": 1.5}), "top_p"),
        (dict(input_ids=[1, 2], sampling_params={"top_k": 0}), "top_k"),
        (dict(input_ids=[1, 2], sampling_params={"top_k": -2}), "top_k"),
        (dict(input_ids=[1, 2], sampling_params={"min_p": 1.5}), "min_p"),
        (dict(input_ids=[1, 2], sampling_params={"max_tokens": 3}), "max_tokens"),
        (dict(input_ids=[1, 2], sampling_params={"temperature": "hot"}), "temperature"),
        (dict(input_ids="1 2"), "input_ids"),
        (dict(prompt=None), "prompt"),
        (dict(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}, top_logprobs_num=1000), "top_logprobs_num"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(engine, kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        engine.generate(**kwargs)
    ok = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(ok["output_ids"]) == 2


def test_construction_errors(qwen3_dir, tmp_path):
    with pytest.raises(ConfigError, match="model_path"):
        Engine(str(tmp_path / "nope"), **SMALL)
    with pytest.raises(ConfigError, match="dtype"):
        Engine(qwen3_dir[0], **{**SMALL, "dtype": "int8"})
    with pytest.raises(ConfigError, match="max_total_tokens"):
        Engine(qwen3_dir[0], max_total_tokens=4, page_size=4, context_length=64, **SMALL)
    with pytest.raises(ConfigError, match="unknown Engine argument"):
        Engine(qwen3_dir[0], pp_size=2, **SMALL)


# --------------------------------------------------------------------------- compilation
def test_zero_recompilation_after_warmup(engine):
    with compilations() as compiles:
        rng = random.Random(0)
        for _ in range(3):
            prompts = [tm.random_ids(rng.randint(1, 40), seed=rng.randint(0, 10**6)) for _ in range(rng.randint(1, 6))]
            sps = [{"max_new_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.7, 1.0]),
                    "top_k": rng.choice([-1, 5]), "top_p": rng.choice([1.0, 0.8]), "ignore_eos": True}
                   for _ in prompts]
            engine.generate(input_ids=prompts, sampling_params=sps, return_logprob=rng.random() < 0.5)
    assert compiles == []
    # Start-up reports what each bucket's compile took, under the name its progress bar showed.
    per_bucket = engine.get_server_info()["compile_seconds_per_bucket"]
    assert sorted(per_bucket) == sorted(b.label for b in engine.runner.buckets) and all(
        s > 0 for s in per_bucket.values())
    assert "decode B4 sort" in per_bucket and any(k.startswith("extend T") for k in per_bucket)
    # ... and what each traced bucket's tracing and lowering took on the main thread (a bucket
    # loaded from the compiled-step cache is not traced).
    lowered = engine.get_server_info()["lower_seconds_per_bucket"]
    hits = engine.runner.executables.hits if engine.runner.executables is not None else 0
    assert set(lowered) <= set(per_bucket) and all(s > 0 for s in lowered.values())
    assert len(lowered) == len(per_bucket) - hits
    # The Triton lowering memo's counters of the start-up (a CPU engine lowers no Triton kernel).
    assert set(engine.get_server_info()["kernel_lowerings"]) == {"hits", "misses", "uncached"}


# --------------------------------------------------------------------------- stress
def test_stress_retraction_and_aborts(qwen3_dir):
    """A few hundred requests, random lengths, random aborts, a pool small enough to retract."""
    # Its requests sample greedily or at temperature 1, never with top-k / top-p: the engine compiles
    # no sort variant it would not run (disable_top_k_top_p, CI time).
    eng = Engine(qwen3_dir[0], page_size=4, chunked_prefill_size=16, context_length=64, max_total_tokens=96,
                 disable_top_k_top_p=True, **SMALL)
    try:
        rng = random.Random(1)
        results, threads = {}, []

        def worker(i):
            p = tm.random_ids(rng.randint(1, 30), seed=i)
            sp = {"max_new_tokens": rng.randint(1, 30), "temperature": rng.choice([0, 1.0]), "ignore_eos": True}
            results[i] = eng.generate(input_ids=p, sampling_params=sp, rid=f"r{i}")

        for i in range(240):
            th = threading.Thread(target=worker, args=(i,))
            th.start()
            threads.append(th)
            if rng.random() < 0.25:
                time.sleep(rng.random() * 0.01)
                eng.abort(f"r{rng.randint(0, i)}")
        for th in threads:
            th.join(120)
        assert len(results) == 240
        kinds = {r["meta_info"]["finish_reason"]["type"] for r in results.values()}
        assert kinds <= {"length", "abort"} and "length" in kinds
        for r in results.values():
            if r["meta_info"]["finish_reason"]["type"] == "length":
                assert r["meta_info"]["completion_tokens"] == r["meta_info"]["finish_reason"]["length"]
        assert eng.get_server_info()["num_retractions"] > 0
        assert eng.get_server_info()["last_error"] is None
        check_no_leaks(eng)
    finally:
        eng.shutdown()


def test_loop_makes_no_implicit_transfers(engine):
    """Under jax.transfer_guard("disallow") in the loop thread (the module's engine runs under it),
    only the explicit per-step input device_put and output device_get are allowed: a hidden host
    sync would raise and fail requests."""
    outs = engine.generate(input_ids=[tm.random_ids(n, seed=n) for n in (3, 20, 9)],
                           sampling_params={"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9,
                                            "ignore_eos": True})
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert engine.get_server_info()["last_error"] is None
    # The guard is live: the same kind of implicit transfer does raise under it.
    with jax.transfer_guard("disallow"):
        with pytest.raises(Exception):
            np.asarray(jax.numpy.ones(3) + 1)
