"""Top-k over a vocabulary on the device: `lax.top_k` (XLA on GPU sorts every row when k > 16)
against `ops.top_k_in_passes` (passes of XLA's selection kernel) and `ops.top_k_chunked` (the
same over chunks of 1024, then over the candidates), per row count, to choose what `ops.top_k`
runs at each row count (bench/README.md, "top-k in passes").

    PYTHONPATH=. python3 bench/top_k.py --rows 1,2,4,8,16,32,64,128 --k 20 --out OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from jspec.bench.record import environment
from jspec.models import ops


def time_us(fn, x, reps: int) -> float:
    """Median of `reps` timings of 10 back-to-back calls, in us per call."""
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(10):
            out = fn(x)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / 10 * 1e6)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    impls = {"lax_top_k": lambda x: jax.lax.top_k(x, args.k),
             "passes": lambda x: ops.top_k_in_passes(x, args.k),
             "chunked": lambda x: ops.top_k_chunked(x, args.k),
             "ops_top_k": lambda x: ops.top_k(x, args.k)}
    records = []
    for r in (int(v) for v in args.rows.split(",")):
        x = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(r), (r, args.vocab), jnp.float32) * 3)
        rec = {"rows": r, "vocab": args.vocab, "k": args.k,
               **{f"{name}_us": time_us(jax.jit(f), x, args.reps) for name, f in impls.items()}}
        print(json.dumps(rec))
        records.append(rec)
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps({**rec, "env": environment()}) + "\n")


if __name__ == "__main__":
    main()
