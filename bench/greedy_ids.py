"""Greedy output ids of the tiny shipped Qwen3, plain and with its EAGLE3 head, as one JSON line:
run it under two XLA settings and compare the lines, to check that a setting changes no token.

    PYTHONPATH=. python3 bench/greedy_ids.py > a.json; XLA_FLAGS=... PYTHONPATH=. python3 bench/greedy_ids.py > b.json; cmp a.json b.json

`--dtype float32` runs both engines in float32, where plain and EAGLE3 greedy ids must be equal (in
bfloat16 a near-tie may round differently in the decode and verify kernels).

`--grammar` adds `eagle3_regex`: the EAGLE3 engine with the llguidance backend, every request under
a regex that allows any text, so that its decode steps run split and pipelined (on a GPU the
target forward as two loaded copies taken in turn, `jspec/runtime/part_copies.py`); the mask
allows every token, so its ids must equal `eagle3`'s.
"""

from __future__ import annotations

import argparse
import json

from jspec import Engine
from jspec.tiny import tiny_dir

PROMPTS = [[1 + i, 7, 19, 3 * i + 2, 11] * (i + 1) for i in range(6)]
EAGLE3 = dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
              speculative_num_draft_tokens=4, speculative_draft_model_path=tiny_dir("qwen3-eagle3"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--grammar", action="store_true", help="also EAGLE3 with every request under an allow-all regex")
    args = ap.parse_args(argv)
    out = {}
    engines = {"plain": ({}, {}), "eagle3": (EAGLE3, {})}
    if args.grammar:
        engines["eagle3_regex"] = ({**EAGLE3, "grammar_backend": "llguidance"}, {"regex": r"[\s\S]*"})
    for name, (spec, constraint) in engines.items():
        with Engine(tiny_dir("qwen3"), dtype=args.dtype, cuda_graph_bs=[1, 4], max_running_requests=4,
                    show_progress=False, compilation_cache_dir="none", speculative_adaptive=False,
                    chunked_prefill_size=64, context_length=256, **spec) as eng:
            res = eng.generate(input_ids=PROMPTS,
                               sampling_params={"temperature": 0, "max_new_tokens": 48, **constraint})
            out[name] = [r["output_ids"] for r in res]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
