"""Whether a step's workspace depends on the model's depth: `ModelRunner.workspace_bytes` (the
largest prompt and decode buckets compiled against a minimum pool, as an engine sizes its KV pool)
for one model shape at several layer counts. If it does not, the memory plan could compile a
shallow copy of the model instead of the whole one, which is most of a cold start's time outside
the bucket compiles (bench/README.md, "Start-up").

    PYTHONPATH=. python3 bench/workspace_layers.py --presets tiny-qwen3,tiny-qwen3-next --layers 4,8,24 \
        [--hidden 256 --intermediate 512 --vocab 4096] [--out OUT.jsonl]

Preset widths are kept unless --hidden / --intermediate / --vocab override them (the real shapes,
e.g. qwen3-8b, need a GPU's memory only for their weights: the workspace compiles allocate nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jspec.cache.pool import PoolLayout  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402
from jspec.runtime.model_runner import ModelRunner  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny-qwen3,tiny-qwen3-next")
    ap.add_argument("--layers", default="4,8,24")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--batch", type=int, default=8, help="decode bucket")
    ap.add_argument("--tokens", type=int, default=256, help="prompt bucket")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    widths = {k: v for k, v in (("hidden_size", args.hidden), ("intermediate_size", args.intermediate),
                                ("vocab_size", args.vocab)) if v}
    records = []
    for name in args.presets.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            cfg = dict(preset_config(name), num_hidden_layers=layers, **widths)
            model = random_model(parse_hf_config(cfg), dtype=args.dtype, seed=0)
            layout = PoolLayout(page_size=16, num_pages=args.batch * 8 + 1, num_slots=args.batch + 1, pages_per_seq=64)
            runner = ModelRunner(model, layout=layout, decode_batch_sizes=[args.batch], extend_token_sizes=[args.tokens],
                                 max_extend_requests=args.batch, compile=False, progress=False)
            t = time.perf_counter()
            ws = runner.workspace_bytes()
            rec = {"preset": name, "layers": layers, "dtype": args.dtype, **widths, "workspace_bytes": ws,
                   "compile_s": time.perf_counter() - t, "device": jax.devices()[0].device_kind,
                   "jax_version": jax.__version__}
            records.append(rec)
            print(f"{name:>20} {layers:>3} layers: workspace {ws / 2**20:9.2f} MiB, {rec['compile_s']:.1f} s", flush=True)
            del runner, model
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
