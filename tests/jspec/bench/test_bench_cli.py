"""`jspec bench serve | sweep | plot` end to end on a tiny random Qwen3 on CPU.

Each command starts its own Engine, as a user's would; a persistent compilation cache shared by
this module keeps the later starts to a few seconds (reset afterwards, so that other test modules
compile as they did)."""

from __future__ import annotations

import json
import math

import jax
import pytest

from jspec.bench import serve
from jspec.cli import main
from jspec.models.presets import write_random_checkpoint

SERVE_FIELDS = [
    "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "peak_output_throughput", "concurrency",
    "accept_length",
] + [f"{s}_{n}_ms" for n in ("ttft", "tpot", "itl", "e2e_latency")
     for s in ("mean", "median", "std", "p95", "p99", "max")]
RECORD_FIELDS = ["kind", "timestamp", "command", "device", "platform", "num_devices", "jax_version", "commit",
                 "commit_dirty", "settings", "engine_args", "speculative", "metrics", "engine_generated_tokens",
                 "accept_lengths", "errors", "error", "server_info"]


@pytest.fixture(scope="module")
def engine_flags(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    write_random_checkpoint(str(d / "tiny"), "tiny-qwen3")
    yield ["--model-path", str(d / "tiny"), "--dtype", "float32", "--cuda-graph-bs", "1,2,4",
           "--max-running-requests", "4", "--chunked-prefill-size", "64", "--prefill-token-buckets", "64",
           "--context-length", "512", "--compilation-cache-dir", str(d / "xla"), "--quiet"]
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def check_serve_record(rec: dict, n: int, out_lens: list[int] | None = None) -> None:
    assert all(k in rec for k in RECORD_FIELDS), set(RECORD_FIELDS) - set(rec)
    m = rec["metrics"]
    assert all(k in m for k in SERVE_FIELDS), set(SERVE_FIELDS) - set(m)
    assert rec["error"] is None and rec["errors"] == []
    assert m["completed"] == n and m["failed"] == 0 and rec["settings"]["num_requests"] == n
    assert rec["device"] == jax.devices()[0].device_kind and rec["jax_version"] == jax.__version__
    assert len(rec["commit"]) in (40, 7) or rec["commit"] == "unknown"
    # Token counts are the engine's: its own counter over the timed run, and the workload's asks.
    assert m["total_output_tokens"] == rec["engine_generated_tokens"]
    if out_lens is not None:
        assert m["total_output_tokens"] == sum(out_lens)
    assert rec["accept_lengths"] == [1.0] * n and m["accept_length"] == 1.0
    for key in ("duration_s", "request_throughput", "input_throughput", "output_throughput", "total_throughput",
                "peak_output_throughput", "concurrency"):
        assert m[key] > 0 and math.isfinite(m[key]), key
    assert m["total_throughput"] == pytest.approx(m["input_throughput"] + m["output_throughput"])
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        mean, med, p95, p99, mx = (m[f"{s}_{name}_ms"] for s in ("mean", "median", "p95", "p99", "max"))
        assert 0 < med <= p99 <= mx and 0 < mean <= mx and p95 <= p99, name
    assert m["max_ttft_ms"] <= m["max_e2e_latency_ms"]
    assert m["concurrency"] <= (rec["settings"]["max_concurrency"] or n) + 1e-6


def test_serve_random_poisson_capped(engine_flags, tmp_path, capsys):
    """Also --profile: a perfetto trace of the timed run, in a folder named by the point."""
    out = tmp_path / "serve.jsonl"
    rc = main(["bench", "serve", *engine_flags, "--dataset-name", "random", "--num-prompts", "8",
               "--random-input-len", "24", "--random-output-len", "12", "--random-range-ratio", "1",
               "--request-rate", "200", "--max-concurrency", "2", "--output-file", str(out),
               "--profile", str(tmp_path / "trace")])
    assert rc == 0
    (rec,) = read(out)
    assert rec["profile_dir"] == str(tmp_path / "trace" / "none_v2_c2")
    assert list((tmp_path / "trace" / "none_v2_c2").rglob("*.trace.json.gz")), "no perfetto trace written"
    check_serve_record(rec, 8, out_lens=[12] * 8)
    assert rec["metrics"]["total_input_tokens"] == 8 * 24
    assert rec["settings"]["request_rate"] == 200.0 and rec["settings"]["max_concurrency"] == 2
    assert rec["engine_args"]["cuda_graph_bs"] == [1, 2, 4] and rec["speculative"]["speculative_algorithm"] is None
    assert "--request-rate 200.0 --max-concurrency 2" in rec["command"]
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Median TTFT (ms)" in text and "Accept length" in text


def test_serve_sharegpt_and_shared_prefix_on_random_weights(engine_flags, tmp_path):
    out = tmp_path / "serve.jsonl"
    assert main(["bench", "serve", *engine_flags, "--dataset-name", "sharegpt", "--num-prompts", "6",
                 "--sharegpt-output-len", "8", "--sharegpt-context-len", "400", "--output-file", str(out)]) == 0
    # random:PRESET builds the weights in memory (what GPU runs of 8B shapes use).
    random_flags = ["--model-path", "random:tiny-qwen3", *engine_flags[2:]]
    assert main(["bench", "serve", *random_flags, "--dataset-name", "generated-shared-prefix",
                 "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40",
                 "--gsp-question-len", "8", "--gsp-output-len", "6", "--output-file", str(out)]) == 0
    sharegpt, gsp = read(out)  # appended, one record per run
    check_serve_record(sharegpt, 6, out_lens=[8] * 6)
    assert sharegpt["settings"]["tokenizer"] == "byte-fallback"  # the tiny model has no tokenizer.json
    check_serve_record(gsp, 6, out_lens=[6] * 6)
    assert gsp["metrics"]["total_input_tokens"] == 6 * 48 and gsp["settings"]["request_rate"] == "inf"
    assert gsp["settings"]["model_path"] == "random:tiny-qwen3" and gsp["server_info"]["model_path"] == "<random>"


def test_serve_multiturn_chats_grow_their_prompts_and_hit_the_prefix_cache(engine_flags, tmp_path):
    """Each turn's prompt is the chat so far (earlier user tokens and the engine's replies) plus
    its own user tokens; the earlier turns come from the prefix cache."""
    from jspec.api import Engine
    from jspec.bench import datasets as ds
    from jspec.bench.client import run_conversations

    out = tmp_path / "chat.jsonl"
    flags = ["--dataset-name", "sharegpt-multiturn", "--num-prompts", "3", "--multiturn-max-turns", "3",
             "--sharegpt-output-len", "8", "--sharegpt-context-len", "480"]
    assert main(["bench", "serve", *engine_flags, *flags, "--output-file", str(out)]) == 0
    (rec,) = read(out)
    n = rec["settings"]["num_requests"]
    assert n >= 6 and rec["metrics"]["completed"] == n and rec["settings"]["multiturn_max_turns"] == 3
    assert rec["metrics"]["cache_hit_rate"] > 0.3, rec["metrics"]["cache_hit_rate"]
    # The same chats through the client directly: turn k's prompt holds turn k-1's prompt and reply.
    chats = ds.sample_sharegpt_multiturn(3, ds.ByteTokenizer(97), seed=1, max_turns=3, fixed_output_len=8,
                                         context_len=480)
    args = dict(zip(engine_flags[2::2], engine_flags[3::2]))
    with Engine(engine_flags[1], dtype="float32", cuda_graph_bs=[1, 2, 4], max_running_requests=4,
                chunked_prefill_size=64, prefill_token_buckets=[64], context_length=512,
                compilation_cache_dir=args["--compilation-cache-dir"], show_progress=False) as eng:
        results, _ = run_conversations(eng, chats, {"temperature": 0.0, "ignore_eos": True})
    i = 0
    for chat in chats:
        for k, turn in enumerate(chat.turns):
            r = results[i + k]
            assert r.success, r.error
            if k:
                prev = results[i + k - 1]
                assert r.prompt_len == prev.prompt_len + prev.output_len + len(turn.input_ids)
                assert r.cached_tokens >= (prev.prompt_len // 16) * 16 - 16  # page size 16: earlier turns
        i += len(chat.turns)


def test_eos_bias_only_for_constrained_workloads_that_ignore_eos():
    from argparse import Namespace

    def bias(**kw):
        args = Namespace(**{"regex": None, "json_schema": None, "disable_ignore_eos": False, **kw})
        return serve.eos_bias(args, [7, 3])

    assert bias(regex="a+") == bias(json_schema="{}") == bias(alternated_constraint=True) == {"7": -100.0, "3": -100.0}
    assert bias() is None and bias(regex="a+", disable_ignore_eos=True) is None
    assert serve.eos_bias(Namespace(regex="a+", json_schema=None, disable_ignore_eos=False), ()) is None
    args = Namespace(temperature=0.0, disable_ignore_eos=False, regex="a+", json_schema=None)
    assert serve.sampling_params(args, [7])["logit_bias"] == {"7": -100.0}
    assert "logit_bias" not in serve.sampling_params(Namespace(**{**vars(args), "regex": None}), [7])


def test_logprob_flags_reach_generate_beside_the_sampling_params():
    """--return-logprob / --top-logprobs-num / --logprob-start-len ride in the workload's sampling
    dict and reach Engine.generate (and /generate) as its own keywords, not as sampling params;
    asking for input logprobs has the engine compile its input-logprob prompt steps."""
    from argparse import Namespace

    from jspec.bench.client import _request_args
    from jspec.bench.datasets import BenchRequest

    args = Namespace(temperature=0.0, disable_ignore_eos=False, regex=None, json_schema=None, top_logprobs_num=2,
                     logprob_start_len=0)
    sampling = serve.sampling_params(args)
    req = _request_args(BenchRequest(input_ids=[5, 6, 7], output_len=4), sampling)
    assert req["return_logprob"] is True and req["top_logprobs_num"] == 2 and req["logprob_start_len"] == 0
    assert req["sampling_params"] == {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 4}
    plain = serve.sampling_params(Namespace(temperature=0.0, disable_ignore_eos=False))
    assert "return_logprob" not in plain and "logprob_start_len" not in plain


def test_serve_asks_for_input_logprobs(engine_flags, tmp_path, monkeypatch):
    """A run with --logprob-start-len 0 serves every request with its prompt's and its output's
    logprobs (the engine's input-logprob prompt steps compiled for it), without an error."""
    from jspec.bench import client

    metas, end = [], client._Recorder.end
    monkeypatch.setattr(client._Recorder, "end", lambda self: (metas.append(self.meta), end(self))[1])
    out = tmp_path / "serve.jsonl"
    assert main(["bench", "serve", *engine_flags, "--dataset-name", "random", "--num-prompts", "3",
                 "--random-input-len", "20", "--random-output-len", "5", "--random-range-ratio", "1",
                 "--max-concurrency", "3", "--top-logprobs-num", "2", "--logprob-start-len", "0",
                 "--warmup-requests", "0", "--output-file", str(out)]) == 0
    (rec,) = read(out)
    check_serve_record(rec, 3, out_lens=[5] * 3)
    assert rec["settings"]["logprob_start_len"] == 0 and rec["engine_args"]["enable_input_logprobs"] is True
    assert len(metas) == 3
    for meta in metas:
        assert len(meta["output_token_logprobs"]) == 5 and len(meta["output_top_logprobs"][0]) == 2
        assert len(meta["input_token_logprobs"]) == 20  # from position 0: the first one has no logprob


ANY_TEXT = r"[\s\S]*"  # allows EOS from the first token on


def _eos_heavy_checkpoint(path: str) -> str:
    """The tiny Qwen3 with its EOS (token 2) embedding scaled 4x: with tied embeddings, greedy
    decoding of the bench's random prompts then picks EOS within a few tokens for most of them."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    write_random_checkpoint(path, "tiny-qwen3")
    f = f"{path}/model.safetensors"
    weights = load_file(f)
    weights["model.embed_tokens.weight"][2] *= np.float32(4.0)
    save_file(weights, f, metadata={"format": "pt"})
    return path


def test_serve_alternates_a_constraint_on_one_engine(engine_flags, tmp_path, capsys, monkeypatch):
    """--alternate-constraint: the workload with and without the regex, alternated on one engine,
    each run its own seed (its own prompts), one record per run, and the constraint's cost. On a
    model that picks EOS early, both sides still make every token the workload asks for: EOS,
    which would end the grammar whatever ignore_eos says, is biased away on both."""
    from bench.vocab_tokenizer import build

    tok = tmp_path / "tok"
    tok.mkdir()
    build(512).save(str(tok / "tokenizer.json"))
    out = tmp_path / "ab.jsonl"
    flags = list(engine_flags)
    flags[flags.index("--model-path") + 1] = _eos_heavy_checkpoint(str(tmp_path / "eos_heavy"))
    assert main(["bench", "serve", *flags, "--dataset-name", "random", "--num-prompts", "4",
                 "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1",
                 "--max-concurrency", "4", "--grammar-backend", "llguidance", "--tokenizer-path", str(tok),
                 "--regex", ANY_TEXT, "--alternate-constraint", "2", "--output-file", str(out)]) == 0
    recs = read(out)
    assert [(r["constraint"], r["round"]) for r in recs] == [("off", 0), ("on", 0), ("on", 1), ("off", 1)]
    for r in recs:
        check_serve_record(r, 4, out_lens=[8] * 4)
        assert r["settings"]["regex"] == (ANY_TEXT if r["constraint"] == "on" else None)
        assert r["settings"]["eos_logit_bias"] == {"2": -100.0} and r["server_info"]["eos_token_ids"] == [2]
        assert "--alternate-constraint 2" in r["command"]
    assert len({r["settings"]["seed"] for r in recs}) == 4  # no run reuses another's prompts
    text = capsys.readouterr().out
    assert "constraint on:" in text and "constraint off:" in text and "constraint cost:" in text
    # Without the bias the constrained requests end at EOS (the model above picks it early).
    monkeypatch.setattr(serve, "eos_bias", lambda args, eos_token_ids: None)
    unbiased = tmp_path / "unbiased.jsonl"
    assert main(["bench", "serve", *flags, "--dataset-name", "random", "--num-prompts", "8",
                 "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1",
                 "--max-concurrency", "4", "--grammar-backend", "llguidance", "--tokenizer-path", str(tok),
                 "--regex", ANY_TEXT, "--alternate-constraint", "1", "--output-file", str(unbiased)]) == 0
    made = {r["constraint"]: r["metrics"]["total_output_tokens"] for r in read(unbiased)}
    assert made["off"] == 64 > made["on"]
    monkeypatch.undo()
    for bad in (["--alternate-constraint", "2"], ["--regex", "a", "--alternate-constraint", "0"],
                ["--regex", "a", "--alternate-constraint", "2", "--profile", str(tmp_path / "t")]):
        assert main(["bench", "serve", *engine_flags, *bad]) == 2
        assert "--alternate-constraint" in capsys.readouterr().err


def test_sweep_then_plot(engine_flags, tmp_path, capsys):
    out = tmp_path / "sweep.jsonl"
    rc = main(["bench", "sweep", *engine_flags, "--dataset-name", "random", "--prompts-per-concurrency", "2",
               "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1",
               "--speculative-algorithm-list", "none,EAGLE3", "--speculative-simulate-accept-length-list", "3",
               "--max-concurrency-list", "1,4", "--output-file", str(out)])
    assert rc == 0
    recs = read(out)
    assert len(recs) == 4
    base = [r for r in recs if r["speculative"]["speculative_algorithm"] is None]
    assert [r["settings"]["max_concurrency"] for r in base] == [1, 4]
    for r in base:
        n = 2 * r["settings"]["max_concurrency"]
        check_serve_record(r, n, out_lens=[8] * n)
        assert r["speedup"] == 1.0 and r["kind"] == "sweep"
    for r in recs[2:]:
        # Speculation is not in the engine yet: the row records why and the sweep goes on. Once it
        # is, these rows hold metrics and a speedup instead.
        assert r["speculative"]["speculative_algorithm"] == "EAGLE3"
        if r["error"] is not None:
            assert r["metrics"] is None and r["speedup"] is None
        else:
            assert r["metrics"]["accept_length"] >= 1.0 and r["speedup"] > 0
    assert "speedup" in capsys.readouterr().out

    assert main(["bench", "plot", str(out), "--out-dir", str(tmp_path / "plots")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["sweep_accept_length.png", "sweep_speedup.png", "sweep_throughput.png"]
    for p in (tmp_path / "plots").iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_bench_step_roofline(tmp_path, monkeypatch):
    """`jspec bench step` times the compiled decode step and reports it against the bytes floor."""
    import functools
    import json as _json

    from jspec.bench import step
    from jspec.cli import main as _main

    # The copy-bandwidth probe over 64 MiB instead of its default 1 GiB (whose random fill and
    # passes took ~15 s of CPU and 2 GiB of memory here); the same code measures it either way.
    monkeypatch.setattr(step, "copy_bandwidth", functools.partial(step.copy_bandwidth, 1 << 26))
    out = tmp_path / "step.jsonl"
    assert _main(["bench", "step", "--model-path", "random:tiny-qwen3", "--dtype", "float32",
                  "--batch-sizes", "1,2", "--context-lens", "32", "--iters", "2",
                  "--output-file", str(out)]) == 0
    recs = [_json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch"], r["context"]) for r in recs] == [(1, 32), (2, 32)]
    for r in recs:
        assert r["kind"] == "step" and r["ms_per_step"] > 0 and r["floor_ms"] > 0
        assert 0 < r["fraction_of_copy_bandwidth"] and r["bytes"]["kv"] > 0
        assert r["bytes"]["total"] == r["bytes"]["weights"] + r["bytes"]["kv"] + r["bytes"]["gdn_state"]
        assert r["copy"]["bytes_per_s"] > 0 and r["copy"]["bytes"] == 2 << 26 and r["speculative_split_ms"] is None
    assert recs[1]["bytes"]["kv"] == 2 * recs[0]["bytes"]["kv"]


def test_bench_step_rejects_bad_flags(capsys):
    from jspec.cli import main as _main

    assert _main(["bench", "step", "--model-path", "random:tiny-qwen3", "--batch-sizes", "0"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err


def test_sweep_grid_skips_the_baseline_only_when_asked():
    import argparse

    from jspec.bench.sweep import grid

    args = argparse.Namespace(speculative_algorithm_list=["EAGLE3"], overlap_list=[True, False],
                              speculative_num_steps_list=[3], speculative_eagle_topk_list=[1],
                              speculative_num_draft_tokens_list=[4], speculative_simulate_accept_length_list=[3.0],
                              speculative_draft_model_path="random")
    algos = [c["speculative_algorithm"] for c in grid(args)]
    assert algos == [None, "EAGLE3", None, "EAGLE3"]
    args.skip_baseline = True
    assert [c["speculative_algorithm"] for c in grid(args)] == ["EAGLE3", "EAGLE3"]
