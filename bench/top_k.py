"""Top-k over a vocabulary on the device: `lax.top_k` (XLA on GPU gives each row one thread block,
and sorts every row when k > 16) against the Pallas kernel `pallas_kernels.top_k` at each block
size and warp count asked (with and without its threshold pass), and `ops.top_k` (what the engine runs), per row count (bench/README.md,
"top-k"). Every implementation's values and ids are checked equal to `lax.top_k`'s first.

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
from pallas_kernels.top_k import top_k as pallas_top_k


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
    ap.add_argument("--blocks", default="1024,2048,4096,8192", help="the Pallas kernel's block sizes")
    ap.add_argument("--warps", default="4,8", help="the Pallas kernel's warp counts")
    ap.add_argument("--thresholds", default="0,1", help="the Pallas kernel without (0) / with (1) its threshold pass")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cpu = jax.default_backend() == "cpu"  # the kernel in interpret mode there (a smoke test, not a timing)
    impls = {"lax_top_k": lambda x: jax.lax.top_k(x, args.k),
             "ops_top_k": lambda x: ops.top_k(x, args.k)}
    for b in (int(v) for v in args.blocks.split(",")):
        for w in (int(v) for v in args.warps.split(",")):
            for t in (v == "1" for v in args.thresholds.split(",")):
                impls[f"pallas_b{b}_w{w}" + "_thr" * t] = lambda x, b=b, w=w, t=t: pallas_top_k(
                    x, args.k, block=b, num_warps=w, interpret=cpu, threshold=t)
    records = []
    for r in (int(v) for v in args.rows.split(",")):
        x = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(r), (r, args.vocab), jnp.float32) * 3)
        want = jax.lax.top_k(x, args.k)
        for name, f in impls.items():
            got = jax.jit(f)(x)
            if not (bool((got[1] == want[1]).all()) and bool((got[0] == want[0]).all())):
                raise SystemExit(f"{name}: top-k differs from lax.top_k at {r} rows")
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
