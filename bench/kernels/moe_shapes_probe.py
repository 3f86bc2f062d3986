"""Launch shapes of the expert-tiled MoE kernels at decode / verify batch sizes with sorted tiles.

`gather_gemv.DEFAULTS` were tuned on one-pair tiles (T <= 16). At the hundreds of tokens of a wide
decode or verify batch on Qwen3-Next (512 experts, top 10: several pairs per expert, sorted tiles) a
decode-step profile showed the down kernel well below the up kernel's rate (bench/README.md). This
probe times each kernel alone over a grid of launch shapes, on R rotated routings inside one jitted
call (weights far above L2), each with the fraction of the copy rate (bytes read + written per
second) that reading every touched expert's slab once in the measured time would be.

    PYTHONPATH=. python3 bench/kernels/moe_shapes_probe.py --out OUT.json [--tokens 128,256,512]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import gather_gemv as gg

X, K, E, I = 512, 10, 2048, 512  # Qwen3-Next experts, top-k, hidden, expert intermediate
R = 4  # routings per call


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def copy_rate() -> float:
    src = jnp.ones((1 << 29 if jax.devices()[0].platform == "gpu" else 1 << 20,), jnp.float32)  # 2 GiB
    f = jax.jit(lambda x: x + 0)
    jax.block_until_ready(f(src))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(src))
        ts.append(time.perf_counter() - t0)
    return 2 * src.nbytes / min(ts)  # read + written


def timed(fn, *args, calls=5, samples=5) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts) / R


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="512,128")
    ap.add_argument("--smoke", action="store_true", help="CPU: small shapes, interpret mode, two shapes each")
    args = ap.parse_args()
    global X, E, I
    interp = args.smoke
    if args.smoke:
        X, E, I = 32, 128, 64
        args.tokens = "16"
    rate = copy_rate()
    log(f"copy {rate / 1e12:.2f} TB/s")
    key = jax.random.PRNGKey(0)
    gate_up = (jax.random.normal(key, (X, E, 2 * I), jnp.float32) * 0.02).astype(jnp.bfloat16)
    down = (jax.random.normal(jax.random.fold_in(key, 1), (X, I, E), jnp.float32) * 0.02).astype(jnp.bfloat16)
    rec = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_bytes_per_s": rate,
           "defaults": gg.DEFAULTS, "rows": []}
    for t in [int(v) for v in args.tokens.split(",")]:
        rng = np.random.default_rng(t)
        experts = jnp.asarray(np.stack([np.stack([rng.choice(X, K, replace=False) for _ in range(t)])
                                        for _ in range(R)]).astype(np.int32))  # [R, T, K]
        xs = (jax.random.normal(jax.random.fold_in(key, t), (R, t, E), jnp.float32)).astype(jnp.bfloat16)
        touched = np.mean([len(np.unique(np.asarray(experts[r]))) for r in range(R)])
        up_bytes, down_bytes = touched * E * 2 * I * 2, touched * I * E * 2
        plans = [gg.plan(experts[r], X) for r in range(R)]
        nt = plans[0][0].shape[0]
        tile_expert = jnp.stack([p[0] for p in plans])
        tile_pairs = jnp.stack([p[1] for p in plans])
        up_cfg0 = gg.choose(nt, E, 2 * I, mode="up")
        gus = jax.jit(lambda te, tp, x: jnp.stack([gg.gathered_gemv(te[r], tp[r], x[r], gate_up, mode="up",
                                                                    cfg=up_cfg0, top_k=K, interpret=interp)
                                                  for r in range(R)]))(
            tile_expert, tile_pairs, xs)

        def run(mode, cfg):
            if mode == "up":
                f = jax.jit(lambda te, tp, x, w: [gg.gathered_gemv(te[r], tp[r], x[r], w, mode="up", cfg=cfg, top_k=K,
                                                                   interpret=interp) for r in range(R)])
                return timed(f, tile_expert, tile_pairs, xs, gate_up)
            f = jax.jit(lambda te, tp, g, w: [gg.gathered_gemv(te[r], tp[r], g[r], w, mode="down", cfg=cfg, top_k=K,
                                                               interpret=interp) for r in range(R)])
            return timed(f, tile_expert, tile_pairs, gus, down)

        grids = (("down", dict(block_n=(128, 256, 512), block_k=(32, 64, 128), num_warps=(4, 8), num_stages=(3, 4))),
                 ("up", dict(block_n=(256, 512), block_k=(64,), num_warps=(4, 8), num_stages=(3, 4))))
        if args.smoke:
            grids = (("down", dict(block_n=(64, 128), block_k=(32,), num_warps=(4,), num_stages=(3,))),
                     ("up", dict(block_n=(64, 128), block_k=(32,), num_warps=(4,), num_stages=(3,))))
        for mode, grid in grids:
            k_dim, n_dim = (E, 2 * I) if mode == "up" else (I, E)
            need = up_bytes if mode == "up" else down_bytes
            default = gg.choose(nt, k_dim, n_dim, mode=mode)
            for bn, bk, w, st in itertools.product(*grid.values()):
                try:
                    cfg = gg.choose(nt, k_dim, n_dim, mode=mode, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
                    sec = run(mode, cfg)
                    row = {"tokens": t, "mode": mode, "cfg": cfg.__dict__, "default": cfg == default, "us": sec * 1e6,
                           "frac_of_copy": need / sec / rate}
                except Exception as e:  # noqa: BLE001 (shared memory over the limit, say)
                    row = {"tokens": t, "mode": mode, "cfg": dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st),
                           "error": f"{type(e).__name__}: {str(e)[:200]}"}
                rec["rows"].append(row)
                if "us" in row:
                    log(f"T={t} {mode} {cfg} {'DEFAULT ' if row['default'] else ''}{row['us']:.1f} us "
                        f"{row['frac_of_copy']:.2f}")
                with open(args.out, "w") as f:
                    json.dump(rec, f, indent=1)
        for mode in ("up", "down"):
            rows = [r for r in rec["rows"] if r["tokens"] == t and r["mode"] == mode and "us" in r]
            best = min(rows, key=lambda r: r["us"])
            dflt = next((r for r in rows if r["default"]), best)
            log(f"T={t} {mode}: default {dflt['us']:.1f} us ({dflt['frac_of_copy']:.2f}), best {best['us']:.1f} us "
                f"({best['frac_of_copy']:.2f}) at {best['cfg']}")


T0 = time.perf_counter()
if __name__ == "__main__":
    main()
