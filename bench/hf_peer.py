"""HF transformers as a peer on the same weights and prompts: greedy `generate` (dynamic
and static cache) and assisted generation with a draft model, against jspec without speculation
and with the same draft model as STANDALONE, all at batch 1, one prompt after another.

Default models: the shipped tiny family (`data/tiny/qwen3` + `qwen3-draft`) and the first
held-out ShareGPT prompts (from `--heldout-tokens` where the data package is absent). Every run's
greedy tokens are compared with HF's plain greedy output, so the table is also a cross-check.

Usage: python bench/hf_peer.py --out hf_peer.json [--num-prompts 8] [--max-new-tokens 64]
       [--target DIR --draft DIR] [--heldout-tokens FILE] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_decode import commit, log  # noqa: E402
from jspec.tiny import tiny_dir  # noqa: E402

TINY = tiny_dir()


def hf_runs(target, draft, prompts, n_new, dtype, device):
    """{mode: (outputs, seconds)} for HF greedy (dynamic / static cache) and assisted generation."""
    import torch
    from transformers import AutoModelForCausalLM

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(target, torch_dtype=tdt).to(device).eval()
    small = AutoModelForCausalLM.from_pretrained(draft, torch_dtype=tdt).to(device).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # eos_token_id None: every run makes exactly n_new tokens, as jspec's ignore_eos does.
    base = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    modes = {"hf_greedy": {}, "hf_greedy_static": {"cache_implementation": "static"},
             "hf_assisted": {"assistant_model": small},
             "hf_assisted_3": {"assistant_model": small, "num_assistant_tokens": 3,
                               "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}}
    out = {}
    for mode, kw in modes.items():
        try:
            with torch.no_grad():
                hf.generate(torch.tensor([prompts[0]], device=device), **dict(base, **kw, max_new_tokens=4,
                                                                               min_new_tokens=4))  # warm
                sync()
                t, toks = time.perf_counter(), []
                for p in prompts:
                    ids = torch.tensor([p], device=device)
                    toks.append(hf.generate(ids, **base, **kw)[0, len(p):].tolist())
                sync()
                out[mode] = (toks, time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - a peer mode this transformers lacks is reported, not fatal
            out[mode] = (None, repr(e)[:300])
        log(f"{mode}: " + (f"{len(prompts) * n_new / out[mode][1]:.1f} tok/s" if out[mode][0] is not None
                           else out[mode][1]))
    return out


def jspec_runs(target, draft, prompts, n_new, dtype):
    """{mode: (outputs, seconds, accept length)} for jspec without speculation and STANDALONE 3/1/4."""
    from jspec.api import Engine

    out = {}
    for mode, spec in (("jspec", {}), ("jspec_standalone", dict(
            speculative_algorithm="STANDALONE", speculative_draft_model_path=draft, speculative_num_steps=3,
            speculative_eagle_topk=1, speculative_num_draft_tokens=4))):
        longest = max(len(p) for p in prompts) + n_new
        eng = Engine(target, dtype=dtype, cuda_graph_bs=[1], max_running_requests=1, chunked_prefill_size=512,
                     prefill_token_buckets=[512], context_length=max(512, longest + 16), disable_top_k_top_p=True,
                     show_progress=False, **spec)
        try:
            sp = {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}
            eng.generate(input_ids=prompts[0], sampling_params=dict(sp, max_new_tokens=4))  # warm
            t, toks = time.perf_counter(), []
            for p in prompts:
                toks.append(eng.generate(input_ids=p, sampling_params=sp)["output_ids"])
            sec = time.perf_counter() - t
            acc = eng.get_server_info().get("avg_spec_accept_length")
        finally:
            eng.shutdown()
        out[mode] = (toks, sec, acc)
        log(f"{mode}: {len(prompts) * n_new / sec:.1f} tok/s" + (f", accept {acc:.2f}" if acc else ""))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default=os.path.join(TINY, "qwen3"))
    ap.add_argument("--draft", default=os.path.join(TINY, "qwen3-draft"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--heldout-tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)

    import jax
    import torch

    from jspec.demo import heldout_prompts
    from jspec.models.loader import load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = heldout_prompts(args.num_prompts, args.max_prompt_tokens, load_tokenizer(args.target),
                              args.heldout_tokens)
    n = args.max_new_tokens
    ours = jspec_runs(args.target, args.draft, prompts, n, args.dtype)
    peer = hf_runs(args.target, args.draft, prompts, n, args.dtype, device)
    ref = peer["hf_greedy"][0]
    rows = {}
    for mode, (toks, sec, *acc) in {**ours, **peer}.items():
        if toks is None:
            rows[mode] = {"error": sec}
            continue
        rows[mode] = {"tok_per_s": len(prompts) * n / sec, "seconds": sec,
                      "same_tokens_as_hf_greedy": None if ref is None else sum(a == b for a, b in zip(toks, ref)),
                      **({"accept_length": acc[0]} if acc and acc[0] else {})}
    for mode, r in rows.items():
        if "tok_per_s" in r and "tok_per_s" in rows.get("jspec", {}):
            r["jspec_over_this"] = rows["jspec"]["tok_per_s"] / r["tok_per_s"]
            r["jspec_standalone_over_this"] = rows["jspec_standalone"]["tok_per_s"] / r["tok_per_s"]
    res = {"device": jax.devices()[0].device_kind, "torch_device": device, "jax_version": jax.__version__,
           "torch_version": torch.__version__, "transformers_version": __import__("transformers").__version__,
           "commit": commit(), "command": "python " + " ".join(sys.argv), "target": args.target,
           "draft": args.draft, "dtype": args.dtype, "num_prompts": len(prompts), "max_new_tokens": n,
           "batch": 1, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    for mode, r in rows.items():
        log(f"{mode:18s} " + (f"{r['tok_per_s']:9.1f} tok/s  same tokens as HF greedy: "
                              f"{r['same_tokens_as_hf_greedy']}/{len(prompts)}" if "tok_per_s" in r else r["error"]))
    return res


if __name__ == "__main__":
    main()
