"""Host time a jitted call spends on its parameter argument: flax's `State` of `Param` nodes (which
flatten in Python) against the flat tuple of the same arrays that the engine's steps take
(`jspec.runtime.step.with_flat_params`). A preset's layer structure at tiny widths, so that it runs
anywhere; the call's body does nothing with the parameters, so what is timed is argument handling.

    PYTHONPATH=. python3 bench/param_call_cost.py --preset qwen3-8b [--out OUT.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jspec.bench.record import append_jsonl, environment  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402


def per_call_us(fn, *args, reps: int = 2000) -> float:
    fn(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cfg = parse_hf_config(preset_config(args.preset))
    # Same layers and parameter tree, tiny widths.
    small = dataclasses.replace(cfg, vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    params = random_model(small, dtype="bfloat16", seed=0, scale=0.02).params
    leaves = tuple(jax.tree_util.tree_leaves(params))
    x = jnp.zeros((4,), jnp.int32)
    body = jax.jit(lambda p, x: x + 1)
    rec = {"preset": args.preset, "layers": cfg.num_hidden_layers, "leaves": len(leaves),
           "state_us": per_call_us(body, params, x), "flat_tuple_us": per_call_us(body, leaves, x),
           "no_params_us": per_call_us(jax.jit(lambda x: x + 1), x)}
    print(json.dumps(rec))
    if args.out:
        append_jsonl(args.out, [{**rec, "env": environment()}])


if __name__ == "__main__":
    main()
