"""The collectives XLA compiled into each decode step of a split model, per bucket: kind (all-reduce,
all-gather, ...), shape and the JAX operation they came from. A tensor-parallel decode step should
hold only all-reduces (the row-parallel projections' and the sampler's small candidate buffers);
an all-gather there is a slow NCCL call (bench/README.md, "Tensor parallelism"). Reads the
optimised HLO, so it shows what the GPU pipeline made of the program, which the CPU tests cannot.

    python3 bench/tp_collectives.py --preset qwen3-8b --layers 2 --tp-size 2 --out $OUT/collectives.json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=2, help="layers kept (the collectives repeat per layer)")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from jspec.bench.record import environment
    from jspec.cache.pool import PoolLayout
    from jspec.config import parse_hf_config
    from jspec.models.loader import random_model
    from jspec.models.presets import preset_config
    from jspec.runtime.model_runner import ModelRunner

    cfg = preset_config(args.preset)
    cfg["num_hidden_layers"] = args.layers
    model = random_model(parse_hf_config(cfg), dtype="bfloat16", tp_size=args.tp_size)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    layout = PoolLayout(page_size=16, num_pages=max(batches) * 4 + 1, num_slots=max(batches) + 1, pages_per_seq=4)
    runner = ModelRunner(model, layout=layout, decode_batch_sizes=batches, extend_token_sizes=[],
                         max_extend_requests=1, progress=False)
    res = {"env": environment(), "preset": args.preset, "layers": args.layers, "tp_size": args.tp_size, "buckets": []}
    for bucket, exe in runner.compiled.items():
        found = collectives(exe.as_text())
        counts = collections.Counter(c["op"] for c in found)
        res["buckets"].append({"bucket": bucket.label, "counts": dict(counts),
                               "not_all_reduce": [c for c in found if c["op"] != "all-reduce"]})
        print(f"{bucket.label}: {dict(counts)}")
        for c in found:
            if c["op"] != "all-reduce":
                print(f"    {c['op']} {c['shape']}  <- {c['op_name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
