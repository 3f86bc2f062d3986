"""The skinny matmul kernel (`pallas_kernels/skinny_matmul`) against XLA's two matmul paths, at the
linear layers of a decode step, on a GPU.

Each case is y = x @ w.T with w `[N, K]` of a real model's layer and M rows of x (decode batch
sizes). A timed call runs the matmul over at least 8 copies of w (1 GB or more), each read once, so
that no copy is in L2 when it is read (the step reads each weight once) and a call's device work
outlasts the host's dispatch of the next; the rate is reported as a fraction
of the device's copy bandwidth measured in the same run. XLA's paths are its Triton GEMM fusions
(the engine's choice below `compile_options.CUBLAS_FROM_ROWS` rows) and cuBLAS (from there on).

Phase 1 times a grid of launch shapes on the attention projections at M 1 and 32 (where XLA is
furthest from the copy rate); phase 2 times the best few shapes and both XLA paths on every layer
and M. Every kernel result is checked against a float32 oracle beside XLA's error.

    PYTHONPATH=. python3 bench/kernels/skinny_matmul.py --out OUT.json [--budget-s 400]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.step import copy_bandwidth
from pallas_kernels.skinny_matmul import choose, skinny_matmul

T0 = time.perf_counter()
# (layer, N, K) of Qwen3-8B (hidden 4096, 32 + 2 x 8 heads of 128, intermediate 12288).
LAYERS = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 24576, 4096),
          ("down_proj", 4096, 12288), ("lm_head", 151936, 4096))
COPY_BYTES = 1 << 30  # the copies of w one timed call reads (L2 holds 50-60 MB)
MIN_COPIES = 8


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def timed_s(fn, args, calls: int = 20, rounds: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - start) / calls)
    return statistics.median(ts)


def over_copies(matmul):
    """One call: the matmul of x with every copy of w, all results returned. Each copy is read
    once per call (no two products share a weight that XLA could merge into one dot), and there
    are enough of them for a call's device work to outlast the host's dispatch of the next."""
    return lambda x, ws: tuple(matmul(x, w) for w in ws)


def compiled(fn, x, ws, options=None):
    return jax.jit(fn).lower(x, ws).compile(compiler_options=options or {})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--keep", type=int, default=4, help="launch shapes of phase 1 kept for phase 2")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--smoke", action="store_true", help="CPU: small layers, interpret mode, 2 launch shapes")
    args = ap.parse_args(argv)
    global LAYERS
    if args.smoke:
        LAYERS = tuple((name, n // 64, 4096) for name, n, _ in LAYERS[:2])
    end = T0 + args.budget_s
    copy = copy_bandwidth()
    res = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "copy": copy,
           "command": "PYTHONPATH=. python3 bench/kernels/skinny_matmul.py " + " ".join(sys.argv[1:]),
           "commit": os.environ.get("JSPEC_COMMIT"), "phase1": [], "phase2": []}
    log("copy GB/s", round(copy["bytes_per_s"] / 1e9))
    weights = {}
    for i, (name, n, k) in enumerate(LAYERS):
        copies = 2 if args.smoke else max(MIN_COPIES, math.ceil(COPY_BYTES / (n * k * 2)))
        base = jax.random.normal(jax.random.key(i), (n, k), jnp.float32) * k ** -0.5
        weights[name] = tuple((base * (1 + 0.01 * c)).astype(jnp.bfloat16) for c in range(copies))
    xs = {m: jax.random.normal(jax.random.key(100 + m), (m, 4096), jnp.float32).astype(jnp.bfloat16)
          for m in (int(r) for r in args.rows.split(","))}

    w32 = {}  # the first copy of each layer's w on the host, for the oracle

    def rate(seconds, name):
        n, k = weights[name][0].shape
        return len(weights[name]) * n * k * 2 / seconds / copy["bytes_per_s"]

    def run(name, m, label, fn, options=None):
        ws = weights[name]
        x = xs[m] if ws[0].shape[1] == 4096 else jnp.tile(xs[m], (1, ws[0].shape[1] // 4096))
        exe = compiled(over_copies(fn), x, ws, options)
        s = timed_s(exe, (x, ws), calls=5)
        y = np.asarray(exe(x, ws)[0], np.float64)
        if name not in w32:
            w32[name] = np.asarray(ws[0], np.float32)
        oracle = (np.asarray(x, np.float32) @ w32[name].T).astype(np.float64)  # float32 products: exact enough
        err = float(np.linalg.norm(y - oracle) / np.linalg.norm(oracle))
        rec = {"layer": name, "rows": m, "impl": label, "us": s / len(ws) * 1e6, "of_copy": rate(s, name),
               "rel_l2": err}
        log(f"{name:>12} M{m:<3} {label:<40} {rec['us']:8.1f} us {rec['of_copy']:.3f} of copy  err {err:.4f}")
        return rec

    grid = list(itertools.product((32, 64), (64, 128, 256), (1, 2, 4), (3, 4)))
    scores = {}
    for name, m in (("qkv_proj", 32), ("o_proj", 32), ("qkv_proj", 1), ("o_proj", 1)):
        n, k = weights[name][0].shape
        for bn, bk, pps, stages in grid[:2] if args.smoke else grid:
            if time.perf_counter() > end - 120:
                break
            cfg = choose(n, k, block_n=bn, block_k=bk, programs_per_sm=pps, num_stages=stages)
            try:
                rec = run(name, m, str(cfg), lambda x, w, cfg=cfg: skinny_matmul(x, w, cfg=cfg, interpret=args.smoke))
            except Exception as e:  # noqa: BLE001 - a shape Triton cannot compile (shared memory)
                log("failed", cfg, type(e).__name__, str(e)[:200])
                continue
            rec["shape"] = [bn, bk, pps, stages]
            res["phase1"].append(rec)
            scores.setdefault((bn, bk, pps, stages), []).append(rec["of_copy"])
    ranked = sorted((s for s in scores if len(scores[s]) == 4), key=lambda s: -statistics.geometric_mean(scores[s]))
    best = ranked[: args.keep]
    res["best_shapes"] = [list(s) for s in best]
    log("best shapes", best)
    for name, n, k in LAYERS:
        for m in xs:
            if time.perf_counter() > end:
                break
            for label, opts in (("xla_triton_gemm", {"xla_gpu_enable_triton_gemm": True}),
                                ("xla_cublas", {"xla_gpu_enable_triton_gemm": False})):
                res["phase2"].append(run(name, m, label, lambda x, w: x @ w.T, opts))
            for bn, bk, pps, stages in best:
                cfg = choose(n, k, block_n=bn, block_k=bk, programs_per_sm=pps, num_stages=stages)
                rec = run(name, m, str(cfg), lambda x, w, cfg=cfg: skinny_matmul(x, w, cfg=cfg, interpret=args.smoke))
                rec["shape"] = [bn, bk, pps, stages]
                res["phase2"].append(rec)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
