"""`jspec bench` without a real engine: workloads, ShareGPT filtering and offline loading, metrics,
flag errors, and a sweep through a stand-in engine that speculates (accept length > 1)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from jspec.bench import datasets as ds
from jspec.bench.client import RequestResult, arrival_offsets
from jspec.bench.metrics import peak_output_throughput, summarize
from jspec.bench.sweep import run_sweep
from jspec.cli import build_parser, main
from tests.support.models import word_tokenizer


# --------------------------------------------------------------------------- workloads
def test_random_lengths_ranges_and_seed():
    reqs = ds.sample_random(200, 40, 30, 0.5, vocab_size=97, seed=3)
    assert all(20 <= len(r.input_ids) <= 40 and 15 <= r.output_len <= 30 for r in reqs)
    assert all(0 <= t < 97 for r in reqs for t in r.input_ids)
    again = ds.sample_random(200, 40, 30, 0.5, vocab_size=97, seed=3)
    assert [r.input_ids for r in again] == [r.input_ids for r in reqs]
    fixed = ds.sample_random(5, 40, 30, 1.0, vocab_size=97, seed=3)
    assert {(len(r.input_ids), r.output_len) for r in fixed} == {(40, 30)}


def test_generated_shared_prefix_groups_share_their_system_prompt():
    reqs = ds.sample_generated_shared_prefix(3, 4, 10, 5, 7, vocab_size=50, seed=0)
    assert len(reqs) == 12 and all(len(r.input_ids) == 15 and r.output_len == 7 for r in reqs)
    for g in range(3):
        prefixes = {tuple(r.input_ids[:10]) for r in reqs if r.group == g}
        assert len(prefixes) == 1
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled


def _conv(*values: str) -> dict:
    """A ShareGPT conversation whose turns alternate human, gpt, human, ..."""
    return {"id": "x", "conversations": [{"from": ("human", "gpt")[i % 2], "value": v} for i, v in enumerate(values)]}


def test_sharegpt_filters_follow_sglang(tmp_path):
    # Byte fallback: one token per ASCII character, so lengths are exact.
    data = [
        _conv("only one turn"),                       # < 2 turns
        _conv("abc", "long enough reply"),            # prompt_len 3 < 4
        _conv("fine prompt", "abc"),                  # output_len 3 < 4
        _conv("p" * 1025, "reply"),                   # prompt_len > 1024
        _conv("q" * 1000, "r" * 1049),                # prompt + output = 2049 > 2048
        _conv("kept prompt", "kept reply"),           # 11 / 10
        {"id": "y", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "a question"},
                                      {"from": "gpt", "value": "an answer"}]},  # first human turn + its reply
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    enc = ds.ByteTokenizer(512)
    got = ds.sample_sharegpt(100, enc, seed=0, path=str(path))
    assert sorted((len(r.input_ids), r.output_len) for r in got) == [(10, 9), (11, 10)]
    # A fixed output length lifts the prompt + output <= 2048 rule (SGLang's), not the others.
    got = ds.sample_sharegpt(100, enc, seed=0, fixed_output_len=8, path=str(path))
    assert sorted(len(r.input_ids) for r in got) == [10, 11, 11, 1000]
    got = ds.sample_sharegpt(100, enc, seed=0, fixed_output_len=8, context_len=100, path=str(path))
    assert sorted(len(r.input_ids) for r in got) == [10, 11, 11]


def test_sharegpt_multiturn_takes_consecutive_exchanges_within_the_limits(tmp_path):
    data = [
        _conv("first question", "first answer", "second question", "second answer", "third q?", "third a!"),
        _conv("one turn only", "its answer"),  # fewer than two turns: dropped
        _conv("question one", "answer one", "abc", "short prompt ends the chat"),  # 3-token turn: 1 turn left
        _conv("q" * 30, "a" * 30, "q" * 30, "a" * 30, "q" * 30, "a" * 30),  # the context limit cuts turn 3
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    enc = ds.ByteTokenizer(512)
    chats = ds.sample_sharegpt_multiturn(10, enc, seed=0, max_turns=4, context_len=150, path=str(path))
    got = sorted([(len(t.input_ids), t.output_len) for t in c.turns] for c in chats)
    assert got == [[(14, 12), (15, 13), (8, 8)], [(30, 30), (30, 30)]]
    chats = ds.sample_sharegpt_multiturn(10, enc, seed=0, max_turns=2, fixed_output_len=5, path=str(path))
    assert sorted(len(c.turns) for c in chats) == [2, 2] and {t.output_len for c in chats for t in c.turns} == {5}


def test_sharegpt_truncated_file_keeps_complete_conversations(tmp_path, capsys):
    text = json.dumps([_conv("first prompt", "first reply"), _conv("second prompt", "second reply")])
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex("second reply") + 3])
    pairs = ds.load_sharegpt_pairs(str(path))
    assert pairs == (("first prompt", "first reply"),)
    assert "truncated" in capsys.readouterr().err


def test_sharegpt_package_loads_without_network(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the ShareGPT loader tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    ds._load_pairs.cache_clear()
    pairs = ds.load_sharegpt_pairs()
    assert len(pairs) > 10_000 and all(isinstance(p, str) and isinstance(r, str) for p, r in pairs[:100])
    reqs = ds.sample_sharegpt(50, ds.ByteTokenizer(512), seed=1, fixed_output_len=16)
    assert len(reqs) == 50 and all(4 <= len(r.input_ids) <= 1024 and r.output_len == 16 for r in reqs)


def test_sharegpt_uses_the_model_tokenizer_when_present():
    tok = word_tokenizer({"[unk]": 0, "hello": 1, "world": 2}, unk="[unk]")
    enc = ds.text_encoder(tok, 3)
    assert enc.encode("hello world again") == [1, 2, 0] and enc.name == "tokenizer.json"
    assert ds.text_encoder(None, 3).encode("ab") == [97 % 3, 98 % 3]


# --------------------------------------------------------------------------- metrics
def test_summary_metrics_by_hand():
    # Two requests: 3 tokens at 0.1/0.2/0.3 s, and 2 tokens at 0.2/0.5 s, 1 verify pass each chunk.
    a = RequestResult(prompt_len=10, output_len=3, success=True, ttft=0.1, latency=0.3, itl=[0.1, 0.1],
                      token_times=[0.1, 0.2, 0.3])
    b = RequestResult(prompt_len=6, output_len=2, success=True, ttft=0.2, latency=0.5, itl=[0.3],
                      token_times=[0.2, 0.5])
    bad = RequestResult(prompt_len=99, error="boom")
    m = summarize([a, b, bad], duration=0.5)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 16, 5)
    assert m["output_throughput"] == pytest.approx(10.0) and m["request_throughput"] == pytest.approx(4.0)
    assert m["concurrency"] == pytest.approx(1.6) and m["accept_length"] == 1.0
    assert m["mean_tpot_ms"] == pytest.approx((100 + 300) / 2)  # (0.3-0.1)/2 and (0.5-0.2)/1
    assert m["max_itl_ms"] == pytest.approx(300) and m["median_ttft_ms"] == pytest.approx(150)
    assert m["peak_output_throughput"] == pytest.approx(10.0)  # window = the whole 0.5 s run
    assert summarize([bad], 1.0)["mean_ttft_ms"] is None


def test_peak_throughput_finds_the_busiest_second():
    times = [0.0, 0.1] + [2.0 + i * 0.01 for i in range(50)] + [4.0]
    assert peak_output_throughput(times, duration=5.0) == pytest.approx(50.0)


def test_poisson_arrivals_are_seeded():
    a, b = arrival_offsets(100, 20.0, seed=5), arrival_offsets(100, 20.0, seed=5)
    assert (a == b).all() and a[0] == 0.0 and (a[1:] >= a[:-1]).all()
    assert 2.5 < a[-1] < 8.0  # about 99 / 20 s
    assert (arrival_offsets(4, float("inf"), 0) == 0).all()


# --------------------------------------------------------------------------- flags
ENGINE = ["--model-path", "/nonexistent"]


@pytest.mark.parametrize("argv,flag", [
    (["bench", "serve", *ENGINE, "--dataset-name", "nope"], "--dataset-name"),
    (["bench", "serve", *ENGINE, "--num-prompts", "many"], "--num-prompts"),
    (["bench", "serve", *ENGINE, "--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
    (["bench", "sweep", *ENGINE, "--max-concurrency-list", "1,x"], "--max-concurrency-list"),
    (["bench", "sweep", *ENGINE, "--overlap-list", "yes"], "--overlap-list"),
    (["bench", "serve"], "--model-path"),
    (["bench"], "serve"),
])
def test_argparse_errors_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("extra,flag", [
    (["--random-input-len", "0"], "--random-input-len"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--request-rate", "0"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--sharegpt-output-len", "2"], "--sharegpt-output-len"),
    (["--gsp-num-groups", "-1"], "--gsp-num-groups"),
    (["--speculative-num-steps", "3"], "--speculative-num-steps"),  # without an algorithm
    (["--model-path", "random:nope"], "random:nope"),
])
def test_range_errors_are_config_errors_naming_the_flag(extra, flag, capsys):
    # Checked before any engine starts: the model path does not even exist.
    assert main(["bench", "serve", *ENGINE, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec bench: error:") and flag in err


def test_sweep_list_errors(capsys):
    assert main(["bench", "sweep", *ENGINE, "--speculative-num-steps-list", "0"]) == 2
    assert "--speculative-num-steps-list" in capsys.readouterr().err


def test_plot_missing_file(tmp_path, capsys):
    assert main(["bench", "plot", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


# --------------------------------------------------------------------------- a speculating stand-in
class _Config:
    vocab_size = 64


class FakeSpecEngine:
    """Streams `accept` tokens per verify pass (one per step without speculation), 2 ms per step,
    and reports spec_verify_ct as the engine will; refuses algorithms other than EAGLE3."""

    def __init__(self, model_path, speculative_algorithm=None, speculative_simulate_accept_length=None, **kw):
        if speculative_algorithm not in (None, "EAGLE3"):
            raise ValueError(f"speculative_algorithm={speculative_algorithm} is not implemented")
        self.config, self.tokenizer = _Config(), None
        self.accept = int(speculative_simulate_accept_length or 1)
        self.spec = speculative_algorithm is not None
        self.generated, self.lock = 0, threading.Lock()
        self.retractions = 0  # one per request, so a row's count is its own requests only

    def generate(self, input_ids, sampling_params, stream):
        n = sampling_params["max_new_tokens"]
        with self.lock:
            self.retractions += 1
        done = verify = 0
        while done < n:
            time.sleep(0.002)
            k = min(self.accept, n - done)
            done, verify = done + k, verify + 1
            with self.lock:
                self.generated += k
            meta = {"completion_tokens": done, "prompt_tokens": len(input_ids), "finish_reason": None}
            if self.spec:
                meta["spec_verify_ct"] = verify
            yield {"output_ids": [7] * k, "meta_info": meta}
        yield {"output_ids": [], "meta_info": {**meta, "finish_reason": {"type": "length", "length": n}}}

    def get_server_info(self):
        return {"num_generated_tokens": self.generated, "num_retractions": self.retractions,
                "num_total_pages": 100}

    def wait_idle(self, timeout=0):
        return True

    def shutdown(self):
        pass


def test_sweep_records_accept_length_speedup_and_errors(tmp_path, capsys):
    out = tmp_path / "sweep.jsonl"
    args = build_parser().parse_args([
        "bench", "sweep", "--model-path", "fake", "--dataset-name", "random", "--num-prompts", "6",
        "--random-input-len", "8", "--random-output-len", "12", "--random-range-ratio", "1",
        "--speculative-algorithm-list", "EAGLE3,NGRAM", "--speculative-simulate-accept-length-list", "3",
        "--max-concurrency-list", "1,3", "--warmup-requests", "0", "--output-file", str(out)])
    run_sweep(args, "test", engine_factory=FakeSpecEngine)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["speculative"]["speculative_algorithm"], r["settings"]["max_concurrency"]) for r in recs] == [
        (None, 1), (None, 3), ("EAGLE3", 1), ("EAGLE3", 3), ("NGRAM", 1), ("NGRAM", 3)]
    for r in recs[:4]:
        m = r["metrics"]
        assert r["error"] is None and m["completed"] == 6 and m["total_output_tokens"] == 72
        assert r["engine_generated_tokens"] == 72
        assert r["num_retractions"] == 6 and r["num_total_pages"] == 100  # the timed run's, not the warm-up's
    base, spec = recs[0], recs[2]
    assert base["metrics"]["accept_length"] == 1.0 and base["speedup"] == 1.0
    assert spec["metrics"]["accept_length"] == pytest.approx(3.0) and spec["metrics"]["spec_verify_ct"] == 24
    assert spec["accept_lengths"] == [3.0] * 6 and spec["speedup"] > 1.5
    assert spec["speculative"]["speculative_simulate_accept_length"] == 3.0
    for r in recs[4:]:
        assert r["metrics"] is None and "NGRAM is not implemented" in r["error"]
    table = capsys.readouterr().out
    assert "speedup" in table and "EAGLE3" in table and "not implemented" in table and "retract" in table


def test_records_name_the_jspec_knobs_they_ran_under(monkeypatch):
    from jspec.bench.record import environment

    monkeypatch.setenv("JSPEC_GRAMMAR_UNCAPTURED_PARTS", "forward")
    monkeypatch.setenv("JSPEC_COMMIT", "abc1234")
    env = environment()
    assert env["jspec_env"]["JSPEC_GRAMMAR_UNCAPTURED_PARTS"] == "forward"
    assert "JSPEC_COMMIT" not in env["jspec_env"]  # it has its own field
    assert env["commit"] == "abc1234"
