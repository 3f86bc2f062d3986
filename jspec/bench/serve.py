"""`jspec bench serve`: start one Engine, run one workload through it, write one record.

`measure` is the part that the sweep reuses: it takes a started engine, so that one engine
(one compilation) serves every concurrency level of a sweep; `--alternate-constraint` runs it
several times on one engine, with and without the requests' grammar.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

from jspec.bench.client import run_conversations, run_requests
from jspec.bench.datasets import BenchRequest, Conversation, build_workload
from jspec.bench.metrics import accept_length, summarize
from jspec.bench.record import append_jsonl, environment, make_record, serve_table
from jspec.runtime.gil import switch_interval

# Engine keywords that `jspec bench` flags map to one to one (flag --page-size -> page_size).
ENGINE_FLAGS = ("dtype", "page_size", "max_running_requests", "max_total_tokens", "chunked_prefill_size",
                "cuda_graph_bs", "prefill_token_buckets", "context_length", "mem_fraction_static",
                "compilation_cache_dir", "disable_top_k_top_p", "speculative_adaptive",
                "speculative_disable_by_batch_size", "tp_size", "ep_size", "replicate_attention", "disable_radix_cache",
                "schedule_policy", "prefill_first", "max_mamba_cache_size", "mamba_track_interval", "grammar_backend",
                "tokenizer_path", "enable_input_logprobs")
# Speculative keywords, passed to the Engine only when an algorithm is set, so that runs without
# speculation work on engines that do not know them yet.
SPEC_KEYS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
             "speculative_num_draft_tokens", "speculative_draft_model_path", "speculative_simulate_accept_length")
SETTING_KEYS = ("dataset_name", "dataset_path", "num_prompts", "seed", "request_rate", "max_concurrency",
                "warmup_requests", "temperature", "disable_ignore_eos", "random_input_len", "random_output_len",
                "random_range_ratio", "gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len",
                "gsp_question_len", "gsp_output_len", "sharegpt_output_len", "sharegpt_context_len",
                "multiturn_max_turns", "frequency_penalty", "presence_penalty", "repetition_penalty",
                "return_logprob", "top_logprobs_num", "logprob_start_len", "regex", "json_schema")


def engine_kwargs(args) -> dict:
    kw = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k, None) is not None}
    kw["disable_overlap_schedule"] = bool(getattr(args, "disable_overlap_schedule", False))
    if getattr(args, "skip_tokenizer_init", False):
        kw["skip_tokenizer_init"] = True  # no per-step detokenization of streamed requests
    if getattr(args, "enable_mixed_chunk", False):
        kw["enable_mixed_chunk"] = True
    if getattr(args, "logprob_start_len", None) is not None and kw.get("enable_input_logprobs") is None:
        kw["enable_input_logprobs"] = True  # the prompt steps that report input logprobs
    kw["random_seed"] = args.seed
    kw["show_progress"] = not args.quiet
    return kw


def spec_kwargs(args) -> dict:
    if getattr(args, "speculative_algorithm", None) is None:
        return {}
    return {k: getattr(args, k) for k in SPEC_KEYS if getattr(args, k, None) is not None}


def sampling_params(args, eos_token_ids=()) -> dict:
    """Every request's sampling parameters. eos_token_ids: the engine's, biased away when the
    workload is constrained (`eos_bias`)."""
    # ignore_eos by default, as SGLang's bench_serving: every request makes exactly the tokens
    # its workload asks for, so runs compare whatever the weights.
    out = {"temperature": args.temperature, "ignore_eos": not args.disable_ignore_eos}
    for key in ("frequency_penalty", "presence_penalty", "repetition_penalty", "top_logprobs_num",
                "logprob_start_len", "regex", "json_schema"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    if getattr(args, "return_logprob", False) or out.get("top_logprobs_num") or "logprob_start_len" in out:
        out["return_logprob"] = True  # with the other two: passed to Engine.generate, not sampling
    bias = eos_bias(args, eos_token_ids)
    if bias:
        out["logit_bias"] = bias
    return out


def eos_bias(args, eos_token_ids) -> dict | None:
    """{EOS id: -100} (OpenAI's lowest bias) for a workload under --regex / --json-schema with
    ignore_eos, else None. A grammar ends when it takes EOS, whatever ignore_eos says (SGLang's
    rule too), so a constrained request would stop wherever the weights pick EOS and its run would
    make fewer tokens than the same workload unconstrained; biased away, EOS is picked only where
    the grammar allows nothing else. Alternated runs (`alternate_constraint`) bias both sides, so
    both sample under the same parameters but the constraint."""
    constrained = getattr(args, "regex", None) or getattr(args, "json_schema", None) or \
        getattr(args, "alternated_constraint", False)
    if args.disable_ignore_eos or not constrained or not eos_token_ids:
        return None
    return {str(t): -100.0 for t in eos_token_ids}


def settings(args) -> dict:
    s = {k: getattr(args, k, None) for k in SETTING_KEYS}
    s["model_path"] = args.model_path
    # JSON has no infinity; "inf" keeps the file readable by strict parsers (jq, browsers).
    if s["request_rate"] is not None and math.isinf(s["request_rate"]):
        s["request_rate"] = "inf"
    return s


def _warmup(engine, requests: list[BenchRequest], args, sampling: dict) -> None:
    # SGLang's warm-up: the first prompt, at most 32 new tokens, sent `warmup_requests` times at once.
    if args.warmup_requests and requests:
        first = BenchRequest(requests[0].input_ids, min(requests[0].output_len, 32))
        run_requests(engine, [first] * args.warmup_requests, sampling)
        engine.wait_idle(timeout=120.0)


def measure(engine, args, engine_args: dict, env: dict, command: str, kind: str = "serve", **extra) -> dict:
    tok = engine.tokenizer
    if tok is None and getattr(args, "skip_tokenizer_init", False) and os.path.isdir(str(args.model_path)):
        from jspec.models.loader import load_tokenizer

        tok = load_tokenizer(args.model_path)  # the engine skips it; ShareGPT still needs it
    requests, tokenizer = build_workload(args, engine.config.vocab_size, tok)
    chats = bool(requests) and isinstance(requests[0], Conversation)
    eos = engine.get_server_info().get("eos_token_ids") or ()  # a server of an older jspec: none known
    sampling = sampling_params(args, eos)
    _warmup(engine, [c.turns[0] for c in requests] if chats else requests, args, sampling)
    before = engine.get_server_info()
    run = run_conversations if chats else run_requests
    trace_dir = _trace_dir(args, engine_args)
    # In process the engine loop and the client's event loop share one GIL: hand it over as often
    # as `jspec serve` does (its switch interval), so both backends run under the same rule.
    previous = sys.getswitchinterval()
    interval = switch_interval() if hasattr(engine, "generate_stream_async") else None  # None: another process's
    if interval is not None:
        sys.setswitchinterval(interval)
    try:
        with _profiled(trace_dir):
            results, duration = run(engine, requests, sampling, args.request_rate, args.max_concurrency, args.seed)
    finally:
        sys.setswitchinterval(previous)
    engine.wait_idle(timeout=120.0)
    info = engine.get_server_info()
    s = settings(args)
    s["num_requests"] = len(results)
    s["tokenizer"] = tokenizer
    s["switch_interval"] = interval
    s["eos_logit_bias"] = sampling.get("logit_bias")
    errors = sorted({r.error for r in results if not r.success})
    return make_record(
        kind, command, s, {"model_path": args.model_path, **engine_args}, env,
        speculative={k: engine_args.get(k) for k in SPEC_KEYS},
        metrics=summarize(results, duration),
        # What the engine itself counted during the timed run: must equal total_output_tokens.
        engine_generated_tokens=info["num_generated_tokens"] - before["num_generated_tokens"],
        # Requests pushed back to the queue for lack of pages during the timed run (0 when the pool
        # holds the workload), and the pool they competed for.
        num_retractions=info["num_retractions"] - before["num_retractions"],
        num_total_pages=info["num_total_pages"],
        server_avg_spec_accept_length=info.get("avg_spec_accept_length"),
        accept_lengths=[round(accept_length(r), 4) for r in results if r.success],
        errors=errors[:5],
        error=None,
        server_info=info,
        **({"profile_dir": trace_dir} if trace_dir else {}),
        **extra,
    )


def _trace_dir(args, engine_args: dict) -> str | None:
    """--profile DIR: this point's trace folder (algorithm and concurrency), else None."""
    if not getattr(args, "profile", None):
        return None
    algo = engine_args.get("speculative_algorithm") or "none"
    overlap = "v1" if engine_args.get("disable_overlap_schedule") else "v2"
    return os.path.join(args.profile, f"{algo}_{overlap}_c{args.max_concurrency or 'all'}")


def _profiled(trace_dir: str | None):
    """A jax.profiler trace (perfetto, for bench/trace_summary.py) around the timed run, or nothing.
    Without Python's function tracer: it slows every Python call of the host loop several times
    over, which would make a host-bound run look far more host-bound than it is."""
    if trace_dir is None:
        return contextlib.nullcontext()
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options)


def open_model(args):
    """`--model-path random:PRESET` gives random weights of a preset's shape (`jspec make-random`
    names) built in memory: benchmarks of real shapes without writing 16 GB of safetensors."""
    if not str(args.model_path).startswith("random:"):
        return args.model_path
    from jspec.config import parse_hf_config
    from jspec.errors import ConfigError
    from jspec.models.loader import random_model
    from jspec.models.presets import PRESETS, preset_config

    name = args.model_path.split(":", 1)[1]
    if name not in PRESETS:
        raise ConfigError(f"--model-path random:{name}: unknown preset; choose from {', '.join(sorted(PRESETS))}")
    return random_model(parse_hf_config(preset_config(name)), dtype=args.dtype, seed=args.seed,
                        tp_size=getattr(args, "tp_size", None) or 1,
                        expert_parallel=(getattr(args, "ep_size", None) or 1) > 1,
                        replicate_attention=bool(getattr(args, "replicate_attention", None)))


def with_draft(kw: dict, model, args) -> dict:
    """Engine keywords with `--speculative-draft-model-path random` replaced by a drafter of the
    algorithm's format with random weights for the target (EAGLE3: a 32000-token draft
    vocabulary, as published heads use; DFLASH: 5 layers and a block of
    `--speculative-num-draft-tokens`, 16 by default, as z-lab's Qwen3-8B drafter), built in
    memory; the record keeps the word "random"."""
    if kw.get("speculative_draft_model_path") != "random":
        return kw
    from jspec.errors import ConfigError
    from jspec.models.drafters.loader import random_drafter
    from jspec.models.loader import Model

    algo = str(kw.get("speculative_algorithm", "")).upper()
    if not isinstance(model, Model) or algo not in ("EAGLE", "EAGLE3", "NEXTN", "DFLASH"):
        raise ConfigError("--speculative-draft-model-path random: needs --model-path random:PRESET and an "
                          "EAGLE, EAGLE3, NEXTN or DFLASH --speculative-algorithm")
    shape = {"draft_vocab_size": min(32000, model.config.vocab_size)} if algo == "EAGLE3" else {}
    if algo == "DFLASH":
        shape = {"block_size": kw.get("speculative_num_draft_tokens") or 16}
    drafter = random_drafter(algo, model, dtype=model.dtype, seed=args.seed + 1, **shape)
    return {**kw, "speculative_draft_model_path": drafter}


def alternate_constraint(engine, args, kw: dict, env: dict, command: str, **extra) -> list[dict]:
    """`--alternate-constraint ROUNDS`: the workload run 2 x ROUNDS times on one engine, with the
    requests' --regex / --json-schema and without, alternated (off, on, then on, off, ...), each
    run with its own seed (so no run finds another's prompts in the prefix cache) and EOS biased
    away on both sides (`eos_bias`: the same sampling but the constraint). A constraint's
    cost can be smaller than what separate engines (separate compiles, runs apart in time) scatter
    by: on one engine, interleaved, both sides see the same compile and the same drift. One record
    per run (`constraint`: "on" / "off", `round`, and `extra`'s fields). engine: an in-process
    Engine or the HTTP client of a running `jspec serve` (whose client then runs in this process,
    apart from the engine's GIL)."""
    records = []
    for r in range(args.alternate_constraint):
        for phase in (("off", "on") if r % 2 == 0 else ("on", "off")):
            a = argparse.Namespace(**vars(args))
            a.seed = args.seed + 2 * r + (phase == "on")
            a.alternated_constraint = True  # both sides: EOS biased away (`eos_bias`)
            if phase == "off":
                a.regex = a.json_schema = None
            records.append(measure(engine, a, kw, env, command, **{"backend": "engine", **extra}, constraint=phase,
                                   round=r))
    return records


def _alternated(records: list[dict], output_file: str) -> dict:
    """Write and print the alternated runs -> the run the caller checks (the one that completed least)."""
    append_jsonl(output_file, records)
    print(constraint_cost(records))
    print(f"{len(records)} records appended to {output_file}")
    return min(records, key=lambda r: r["metrics"]["completed"])


def constraint_rates(records: list[dict]) -> dict[str, list[float]]:
    """The alternated runs' output tok/s per side: {"off": [...], "on": [...]}."""
    return {side: [r["metrics"]["output_throughput"] for r in records if r.get("constraint") == side]
            for side in ("off", "on")}


def constraint_cost(records: list[dict]) -> str:
    """The alternated runs' output tok/s per side and the constraint's cost (mean on / mean off - 1)."""
    tput = constraint_rates(records)
    mean = {side: sum(v) / len(v) for side, v in tput.items() if v}
    lines = [f"constraint {side}: " + ", ".join(f"{t:.1f}" for t in tput[side]) + f" out tok/s (mean {mean[side]:.1f})"
             for side in mean]
    if len(mean) == 2 and mean["off"]:
        lines.append(f"constraint cost: {100 * (mean['on'] / mean['off'] - 1):+.1f}%")
    return "\n".join(lines)


def run_serve(args, command: str) -> dict:
    env = environment()
    if getattr(args, "backend", "engine") == "http":
        from jspec.bench.http_client import HttpEngine

        # The server's own settings go on record: this run set none of them.
        server = HttpEngine(args.base_url, tokenizer_path=args.model_path)
        info = server.get_server_info()
        kw = {k: info[k] for k in ("model_path", *ENGINE_FLAGS, *SPEC_KEYS) if info.get(k) is not None}
        if getattr(args, "alternate_constraint", None):
            return _alternated(alternate_constraint(server, args, kw, env, command, backend="http",
                                                    base_url=args.base_url), args.output_file)
        rec = measure(server, args, kw, env, command, backend="http", base_url=args.base_url)
    else:
        from jspec.api import Engine

        kw = {**engine_kwargs(args), **spec_kwargs(args)}
        model = open_model(args)
        engine = Engine(model, **with_draft(kw, model, args))
        try:
            if getattr(args, "alternate_constraint", None):
                return _alternated(alternate_constraint(engine, args, kw, env, command), args.output_file)
            rec = measure(engine, args, kw, env, command, backend="engine")
        finally:
            engine.shutdown()
    append_jsonl(args.output_file, [rec])
    print(serve_table(rec))
    print(f"record appended to {args.output_file}")
    return rec
