"""GPU check and timing of the residual add + RMSNorm kernel (`pallas_kernels/rms_norm`) against
the XLA steps it replaces (`reference.add_rms_norm`), at Qwen3-8B's hidden size (4096, bf16) and T
rows per step: the largest difference and fraction of differing elements of both outputs, then
microseconds per call of each (alone, launch included).

    PYTHONPATH=. python3 bench/kernels/add_rms_norm.py --tokens 1,8,32,128,2048 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.record import environment
from pallas_kernels.rms_norm import add_rms_norm
from pallas_kernels.rms_norm import reference as ref


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,128,2048")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    interpret = jax.default_backend() == "cpu"
    kw = dict(eps=1e-6, zero_centred=False)
    impls = {"xla": jax.jit(lambda *a: ref.add_rms_norm(*a, **kw)),
             "kernel": jax.jit(lambda *a: add_rms_norm(*a, **kw, interpret=interpret))}
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        rng = np.random.default_rng(t)
        x = jnp.asarray(rng.standard_normal((t, args.hidden)) * 4, jnp.bfloat16)
        delta = jnp.asarray(rng.standard_normal((t, args.hidden)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal(args.hidden) * 0.1 + 1, jnp.bfloat16)
        outs = {name: fn(x, delta, w) for name, fn in impls.items()}
        row = {"tokens": t}
        for i, part in enumerate(("residual", "normed")):
            a = np.asarray(outs["kernel"][i].astype(jnp.float32))
            b = np.asarray(outs["xla"][i].astype(jnp.float32))
            row[f"{part}_max_abs_diff"] = float(np.abs(a - b).max())
            row[f"{part}_frac_differing"] = float((a != b).mean())
        for name, fn in impls.items():
            jax.block_until_ready(fn(x, delta, w))
            t0 = time.perf_counter()
            for _ in range(args.reps):
                out = fn(x, delta, w)
            jax.block_until_ready(out)
            row[f"{name}_us"] = (time.perf_counter() - t0) / args.reps * 1e6
        print(json.dumps(row))
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "hidden": args.hidden, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
