"""Expert stacks past 2**31 elements through the tiled MoE kernels, on a GPU.

Qwen3.5-397B-A17B has 512 experts of hidden 4096 and intermediate 1024: its gate_up stack holds
2**32 bf16 elements (8 GiB) whole and 2**31 on each of two devices. Pallas's Triton lowering
switches a ref's pointer offsets to 64 bits past 2**32 bytes, so the kernels can address any
stack; this probe checks that on the GPU (routings onto the last experts, whose slabs lie past
4 GiB, and random ones) against a float32 oracle on the gathered weights, and times the kernels
against XLA's gather path (`reference.moe_gather`, what SparseMoE ran for such stacks before).

    PYTHONPATH=. python3 bench/kernels/moe_large_stack_probe.py --out OUT.json [--tokens 1,32,64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels.moe import f32_oracle as oracle
from pallas_kernels.moe import gather_gemv as gg
from pallas_kernels.moe import reference as ref

T0 = time.perf_counter()
# (name, X, K, E, I): the 397B's stacks whole and as each of two devices holds them.
SHAPES = (("qwen3.5-397b_tp1", 512, 10, 4096, 1024), ("qwen3.5-397b_tp2", 512, 10, 4096, 512))


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def routing(kind: str, t: int, x: int, k: int, rng) -> np.ndarray:
    """last: every token on the K highest experts (their slabs end the stack); random: distinct
    experts per token."""
    if kind == "last":
        return np.tile(np.arange(x - k, x, dtype=np.int32), (t, 1))
    return np.stack([rng.choice(x, k, replace=False) for _ in range(t)]).astype(np.int32)


def timed_us(fn, args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - start) / reps)
    return statistics.median(ts) * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,32,64", help="T per case (64 takes sorted tiles at 512 experts, top 10)")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    res = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
           "command": "PYTHONPATH=. python3 bench/kernels/moe_large_stack_probe.py " + " ".join(sys.argv[1:]),
           "commit": os.environ.get("JSPEC_COMMIT"), "cases": []}
    rng = np.random.default_rng(0)
    tiled = jax.jit(gg.moe_gather_pallas)
    gather = jax.jit(ref.moe_gather)
    for name, x_num, k, e, i in SHAPES:
        k1, k2 = jax.random.split(jax.random.key(len(name)))
        gate_up = (jax.random.normal(k1, (x_num, e, 2 * i), jnp.bfloat16) * e ** -0.5).astype(jnp.bfloat16)
        down = (jax.random.normal(k2, (x_num, i, e), jnp.bfloat16) * i ** -0.5).astype(jnp.bfloat16)
        log(name, "gate_up elements", gate_up.size, ">= 2**31:", gate_up.size >= 2**31)
        for t in tokens:
            for kind in ("last", "random"):
                xs = jnp.asarray(rng.standard_normal((t, e)), jnp.bfloat16)
                ex = jnp.asarray(routing(kind, t, x_num, k, rng))
                w = rng.random((t, k))
                w = jnp.asarray(w / w.sum(1, keepdims=True), jnp.bfloat16)
                case = (xs, ex, w, gate_up, down)
                o = jax.jit(oracle)(*case)
                got = tiled(*case).astype(jnp.float32)
                xla = gather(*case).astype(jnp.float32)
                row = {"shape": name, "gate_up_elements": gate_up.size, "T": t, "routing": kind,
                       "sorted_tiles": gg.sorts(t, k, x_num), "tiled_vs_f32_rel_l2": rel(got, o),
                       "xla_gather_vs_f32_rel_l2": rel(xla, o), "tiled_finite": bool(jnp.all(jnp.isfinite(got)))}
                row["ok"] = row["tiled_finite"] and row["tiled_vs_f32_rel_l2"] <= 2 * row["xla_gather_vs_f32_rel_l2"] + 1e-3
                if kind == "random":
                    row["tiled_us"], row["xla_gather_us"] = timed_us(tiled, case), timed_us(gather, case)
                res["cases"].append(row)
                log(row)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
        del gate_up, down
    res["all_ok"] = all(r["ok"] for r in res["cases"])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    log("all ok:", res["all_ok"])


if __name__ == "__main__":
    main()
