"""The collectives XLA compiled into each decode step of a split model's engine, per bucket: kind (all-reduce,
all-gather, ...), shape and the JAX operation they came from. A tensor-parallel decode step should
hold only all-reduces (the row-parallel projections' and the sampler's small candidate buffers);
an all-gather there is a slow NCCL call (bench/README.md, "Tensor parallelism"). Reads the
optimised HLO, so it shows what the GPU pipeline made of the program, which the CPU tests cannot.

    python3 bench/tp_collectives.py --preset qwen3-8b --layers 2 --tp-size 2 --algorithms none,EAGLE3 \
        --out $OUT/collectives.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str) -> list[dict]:
    """One entry per collective instruction (async starts counted, their dones not)."""
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (.+?) ([a-z-]+)\(", line)
        if not m or m.group(2).removesuffix("-start") not in COLLECTIVES:
            continue
        name = re.search(r'op_name="([^"]+)"', line)
        out.append({"op": m.group(2).removesuffix("-start"), "shape": m.group(1),
                    "op_name": name.group(1) if name else None})
    return out


def engine(model, algorithm: str | None, batches: list[int]):
    """An engine as `jspec bench sweep` builds one (random drafter of the algorithm's format)."""
    from jspec.api import Engine
    from jspec.bench.serve import with_draft

    kw = dict(cuda_graph_bs=batches, max_running_requests=max(batches), context_length=1024,
              chunked_prefill_size=256, show_progress=False)
    if algorithm:
        kw.update(speculative_algorithm=algorithm, speculative_num_steps=3, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=4, speculative_draft_model_path="random", speculative_adaptive=False)
        kw = with_draft(kw, model, argparse.Namespace(seed=0))
    return Engine(model, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=2, help="layers kept (the collectives repeat per layer)")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--algorithms", default="none",
                    help="comma-separated: none (plain decode), EAGLE3, NEXTN, ... (a random drafter each)")
    ap.add_argument("--replicate-attention", action="store_true", help="token mixers whole on every device")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from jspec.bench.record import environment
    from jspec.config import parse_hf_config
    from jspec.models.loader import random_model
    from jspec.models.presets import preset_config

    cfg = preset_config(args.preset)
    cfg["num_hidden_layers"] = args.layers
    if cfg.get("full_attention_interval"):  # keep one attention layer among the hybrid's GDN layers
        cfg["num_hidden_layers"] = max(args.layers, cfg["full_attention_interval"])
    model = random_model(parse_hf_config(cfg), dtype="bfloat16", tp_size=args.tp_size,
                         replicate_attention=args.replicate_attention)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    res = {"env": environment(), "preset": args.preset, "layers": cfg["num_hidden_layers"], "tp_size": args.tp_size,
           "replicate_attention": args.replicate_attention, "buckets": []}
    for algo in args.algorithms.split(","):
        eng = engine(model, None if algo.lower() == "none" else algo.upper(), batches)
        try:
            for bucket, exe in eng.runner.compiled.items():
                if bucket.mode.value != "decode":
                    continue
                found = collectives(exe.as_text())
                counts = collections.Counter(c["op"] for c in found)
                res["buckets"].append({"algorithm": algo, "bucket": bucket.label, "counts": dict(counts),
                                       "not_all_reduce": [c for c in found if c["op"] != "all-reduce"]})
                print(f"{algo} {bucket.label}: {dict(counts)}")
                for c in found:
                    if c["op"] != "all-reduce":
                        print(f"    {c['op']} {c['shape']}  <- {c['op_name']}")
        finally:
            eng.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
