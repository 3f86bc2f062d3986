"""Benchmark and GPU check of the routed-expert gather kernels (pallas_kernels/moe).

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 bench/kernels/moe.py --out $OUT/kernels_moe_h200.json [--sweep] [--refine] [--budget-s 250]

In order of priority (a time budget skips the tail rather than lose everything):
1. copy rates through PyTorch (a subprocess, before JAX takes the GPU): a 2 GiB device-to-device
   copy (the ceiling), and a copy of exactly the expert bytes of every case below, rotating over four
   buffer pairs; bytes read + written per second;
2. correctness on the GPU: Pallas and the XLA gather path (`reference.moe_gather`, what
   `SparseMoE._routed_gather` ran before) against a float32 oracle on the gathered weights;
3. with --sweep: launch shapes of the up and down kernels timed alone at Qwen3-Next T=1 (stage A),
   the best few again over warps / stages at T=1 and T=4 (stage B); this chose
   `gather_gemv.DEFAULTS`; with --refine: neighbours of those defaults at T=1 and T=4;
4. the table: Qwen3-Next (X=512, K=10, E=2048, I=512) and Qwen3-30B-A3B (X=128, K=8, E=2048,
   I=768) shapes, bf16, T in {1, 4, 8, 16}: Pallas (default launch shapes, and the sweep's best if
   swept), XLA, and the copy of the same bytes. A path's rate is expert bytes read / time
   (P x 3 x E x I x 2 bytes, P = T*K pairs: a repeated expert counts again, as both paths read it
   again); its fraction is that rate over the copy's (read + written) rate for the same bytes.

Timing: each measured call runs the op on R=32 rotated input sets (tokens, routing) inside one
jitted function, with the expert weights (3.2 GB / 1.2 GB, far above L2) as arguments; five calls
are queued before one `block_until_ready`, so host dispatch overlaps the GPU; median of samples,
divided by 5 x R.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib

import numpy as np

T0 = time.perf_counter()
SHAPES = {
    "qwen3_next": dict(X=512, K=10, E=2048, I=512),
    "qwen3_30b_a3b": dict(X=128, K=8, E=2048, I=768),
}
TOKENS = (1, 4, 8, 16)
# The runner-up for the up kernel (float32 multiply-adds), timed beside the default in the table.
UP_FMA = dict(mma=False, block_n=128, block_k=32, programs_per_sm=4, num_warps=8)
SMOKE_SHAPES = {"tiny": dict(X=16, K=4, E=64, I=48)}

COPY_SCRIPT = r"""
import json, sys, torch
sizes = json.loads(sys.argv[1])
res = {}
for n in sizes:
    pairs = 1 if n >= (1 << 31) else 4
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for _ in range(pairs)]
    dsts = [torch.empty_like(s) for s in srcs]
    for i in range(3):
        dsts[i % pairs].copy_(srcs[i % pairs])
    torch.cuda.synchronize()
    reps = 8 if n >= (1 << 31) else 20
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(reps):
            dsts[i % pairs].copy_(srcs[i % pairs])
        b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    ms = sorted(ts)[len(ts) // 2]
    res[str(n)] = {"ms": ms, "tb_per_s": 2 * n / ms / 1e9}
    del srcs, dsts
    torch.cuda.empty_cache()
print(json.dumps(res))
"""


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def expert_bytes(shape, t, itemsize=2):
    return t * shape["K"] * 3 * shape["E"] * shape["I"] * itemsize


def copy_rates(sizes):
    try:
        out = subprocess.run([sys.executable, "-c", COPY_SCRIPT, json.dumps(sizes)], capture_output=True, text=True,
                             timeout=150)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - report it; fractions are then missing
        return {"error": repr(e)[:500]}


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


class Bench:
    def __init__(self, args):
        import jax

        self.jax = jax
        self.args = args
        self.deadline = T0 + args.budget_s
        self.interpret = args.smoke
        self.shapes = SMOKE_SHAPES if args.smoke else SHAPES
        self.tokens = (1, 4) if args.smoke else TOKENS
        self.sets = 4 if args.smoke else 32
        dev = jax.devices()[0]
        self.res = {
            "device": dev.device_kind,
            "jax_version": jax.__version__,
            "commit": git_commit(),
            "command": "PYTHONPATH=. python3 bench/kernels/moe.py " + " ".join(sys.argv[1:]),
            "timing": "median over samples of (5 queued jitted calls, each the op on 32 rotated input sets) / 160",
            "bytes": "expert bytes read: T*K pairs x 3 x E x I x 2 (bf16)",
            "fraction": "(bytes / time) / (2 x bytes / time of a torch copy of the same bytes)",
            "sections": {},
        }
        self.weights = {}

    def time_left(self):
        return self.deadline - time.perf_counter()

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out, "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    def put(self, section, key, value):
        self.res["sections"].setdefault(section, {})[key] = value
        self.save()

    # ------------------------------------------------------------------------- inputs

    def expert_weights(self, name):
        """gate_up [X, E, 2I], down [X, I, E] bf16, scaled so that activations stay O(1)."""
        if name not in self.weights:
            jax, jnp = self.jax, self.jax.numpy
            s = self.shapes[name]
            k1, k2 = jax.random.split(jax.random.key(zlib.crc32(name.encode())))
            gu = (jax.random.normal(k1, (s["X"], s["E"], 2 * s["I"]), jnp.bfloat16) * (s["E"] ** -0.5)).astype(
                jnp.bfloat16)
            dn = (jax.random.normal(k2, (s["X"], s["I"], s["E"]), jnp.bfloat16) * (s["I"] ** -0.5)).astype(
                jnp.bfloat16)
            self.weights = {name: jax.block_until_ready((gu, dn))}  # one shape's weights at a time
        return self.weights[name]

    def token_sets(self, name, t, n, seed=0):
        """n sets of (x [T, E], experts [T, K] distinct per token, weights [T, K]) in bf16."""
        jnp = self.jax.numpy
        s = self.shapes[name]
        rng = np.random.default_rng(seed + 97 * t)
        sets = []
        for _ in range(n):
            x = rng.standard_normal((t, s["E"]))
            experts = np.argsort(rng.random((t, s["X"])), axis=1)[:, : s["K"]]
            w = rng.random((t, s["K"]))
            w /= w.sum(1, keepdims=True)
            sets.append((jnp.asarray(x, jnp.bfloat16), jnp.asarray(experts, jnp.int32), jnp.asarray(w, jnp.bfloat16)))
        return sets

    # ------------------------------------------------------------------------- timing

    def time_fn(self, fn, sets, weights, *, samples=9, calls=5):
        """Seconds per op call: fn(*set, *weights) over the rotated sets inside one jit."""
        jax = self.jax
        f = jax.jit(lambda sets, weights: [fn(*s, *weights) for s in sets])
        jax.block_until_ready(f(sets, weights))
        if self.args.smoke:
            samples, calls = 2, 1
        ts = []
        for _ in range(samples):
            t = time.perf_counter()
            outs = [f(sets, weights) for _ in range(calls)]
            jax.block_until_ready(outs)
            ts.append((time.perf_counter() - t) / (calls * len(sets)))
        return statistics.median(ts)

    # ------------------------------------------------------------------------- sections

    def moe_fn(self, up=None, down=None):
        from pallas_kernels.moe import gather_gemv as gg

        def fn(x, experts, weights, gate_up, down_w):
            pairs = experts.size
            up_cfg = gg.choose(pairs, x.shape[1], gate_up.shape[2], mode="up", **(up or {}))
            down_cfg = gg.choose(pairs, down_w.shape[1], down_w.shape[2], mode="down", **(down or {}))
            return gg.moe_gather_pallas(x, experts, weights, gate_up, down_w, up_cfg=up_cfg, down_cfg=down_cfg,
                                        interpret=self.interpret)

        return fn

    def section_correctness(self):
        jax, jnp = self.jax, self.jax.numpy
        from pallas_kernels.moe import reference as ref

        def oracle(x, experts, weights, gate_up, down):  # float32 on the gathered experts
            flat = experts.reshape(-1)
            rows = jnp.repeat(x.astype(jnp.float32), experts.shape[1], axis=0)
            hi = jax.lax.Precision.HIGHEST
            h = jnp.einsum("ne,nei->ni", rows, gate_up[flat].astype(jnp.float32), precision=hi)
            g, u = jnp.split(h, 2, axis=-1)
            y = jnp.einsum("ni,nie->ne", jax.nn.silu(g) * u, down[flat].astype(jnp.float32), precision=hi)
            y = y.reshape(*experts.shape, -1) * weights[..., None].astype(jnp.float32)
            return y.sum(1)

        def rel(a, b):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

        ok = True
        for name in self.shapes:
            gu, dn = self.expert_weights(name)
            for t in self.tokens:
                (x, e, w), = self.token_sets(name, t, 1, seed=1)
                # Force repeats across tokens: the last token reuses the first token's experts.
                e = e.at[-1].set(e[0])
                p = jax.jit(self.moe_fn())(x, e, w, gu, dn).astype(jnp.float32)
                xla = jax.jit(ref.moe_gather)(x, e, w, gu, dn).astype(jnp.float32)
                o = jax.jit(oracle)(x, e, w, gu, dn)
                row = {
                    "pallas_vs_f32_rel_l2": rel(p, o),
                    "xla_vs_f32_rel_l2": rel(xla, o),
                    "pallas_vs_xla_rel_l2": rel(p, xla),
                    "pallas_vs_xla_max_abs": float(jnp.max(jnp.abs(p - xla))),
                    "max_abs_out": float(jnp.max(jnp.abs(xla))),
                    "finite": bool(jnp.all(jnp.isfinite(p))),
                }
                row["ok"] = row["finite"] and row["pallas_vs_f32_rel_l2"] <= 2 * row["xla_vs_f32_rel_l2"] + 1e-3
                ok &= row["ok"]
                self.put("correctness", f"{name}_T{t}", row)
                log("correctness", name, t, row)
        self.put("correctness", "all_ok", ok)
        return ok

    def kernel_time(self, name, t, mode, overrides):
        """Time of the up or down kernel alone, with launch-shape overrides."""
        from pallas_kernels.moe import gather_gemv as gg

        s = self.shapes[name]
        gu, dn = self.expert_weights(name)
        sets = self.token_sets(name, t, self.sets)
        pairs = t * s["K"]
        jnp = self.jax.numpy
        if mode == "up":
            cfg = gg.choose(pairs, s["E"], 2 * s["I"], mode="up", **overrides)
            args = [(e.reshape(-1), x) for x, e, _ in sets]
            fn = lambda flat, x, w: gg.gathered_gemv(flat, x, w, mode="up", cfg=cfg, top_k=s["K"],  # noqa: E731
                                                     interpret=self.interpret)
            weights = (gu,)
        else:
            cfg = gg.choose(pairs, s["I"], s["E"], mode="down", **overrides)
            up_cfg = gg.choose(pairs, s["E"], 2 * s["I"], mode="up")
            args = [(e.reshape(-1), jnp.asarray(np.random.default_rng(i).standard_normal(
                (up_cfg.splits, pairs, 2 * s["I"])), jnp.float32)) for i, (_, e, _) in enumerate(sets)]
            fn = lambda flat, src, w: gg.gathered_gemv(flat, src, w, mode="down", cfg=cfg, top_k=s["K"],  # noqa: E731
                                                       interpret=self.interpret)
            weights = (dn,)
        sec = self.time_fn(fn, args, weights)
        bytes_ = pairs * (2 if mode == "up" else 1) * s["E"] * s["I"] * 2
        return sec, bytes_ / sec, cfg

    def section_sweep(self):
        name = next(iter(self.shapes))
        stage_a = []
        for mma, tiles in ((False, [(64, 64), (128, 32), (128, 64), (256, 32)]),
                           (True, [(64, 64), (128, 64), (128, 128), (256, 64)])):
            for bn, bk in tiles:
                for pps in (2, 4, 8):
                    stage_a.append(dict(mma=mma, block_n=bn, block_k=bk, programs_per_sm=pps))
        best = {}
        for mode in ("up", "down"):
            rows = []
            for ov in stage_a:
                if self.time_left() < self.args.reserve_s:
                    break
                try:
                    sec, rate, cfg = self.kernel_time(name, 1, mode, ov)
                    rows.append(dict(ov, us=sec * 1e6, tb_per_s=rate / 1e12, cfg=str(cfg)))
                except Exception as e:  # noqa: BLE001 - a shape Triton rejects: record it, go on
                    rows.append(dict(ov, error=repr(e)[:300]))
                log("sweep A", mode, rows[-1])
                self.put("sweep_stage_a_T1", mode, rows)
            ranked = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:2]
            rows_b = []
            for r in ranked:
                base = {k: r[k] for k in ("mma", "block_n", "block_k", "programs_per_sm")}
                for warps, stages in ((4, 3), (4, 1), (4, 4), (8, 3), (2, 3)):
                    if self.time_left() < self.args.reserve_s:
                        break
                    ov = dict(base, num_warps=warps, num_stages=stages)
                    try:
                        t1, rate1, _ = self.kernel_time(name, 1, mode, ov)
                        t4, rate4, _ = self.kernel_time(name, 4, mode, ov)
                        rows_b.append(dict(ov, us_t1=t1 * 1e6, us_t4=t4 * 1e6, tb_per_s_t1=rate1 / 1e12,
                                           tb_per_s_t4=rate4 / 1e12, score_us=(t1 + t4 / 4) * 1e6))
                    except Exception as e:  # noqa: BLE001
                        rows_b.append(dict(ov, error=repr(e)[:300]))
                    log("sweep B", mode, rows_b[-1])
                    self.put("sweep_stage_b_T1_T4", mode, rows_b)
            done = sorted((r for r in rows_b if "score_us" in r), key=lambda r: r["score_us"])
            if done:
                best[mode] = {k: done[0][k] for k in ("mma", "block_n", "block_k", "programs_per_sm", "num_warps",
                                                      "num_stages")}
        self.put("sweep_best", "overrides", best)
        return best

    def section_refine(self):
        """Neighbours of the defaults, each kernel alone, at T=1 and T=4 (Qwen3-Next)."""
        name = next(iter(self.shapes))
        variants = {
            "up": [{}, dict(programs_per_sm=4), dict(num_warps=8), dict(block_n=128), dict(num_stages=4), UP_FMA],
            "down": [{}, dict(programs_per_sm=1), dict(programs_per_sm=4), dict(block_n=64), dict(block_n=256),
                     dict(num_warps=2), dict(block_k=32), dict(block_k=128)],
        }
        for mode, rows in variants.items():
            out = []
            for ov in rows:
                if self.time_left() < self.args.reserve_s:
                    break
                try:
                    t1, _, cfg1 = self.kernel_time(name, 1, mode, ov)
                    t4, _, _ = self.kernel_time(name, 4, mode, ov)
                    out.append(dict(overrides=ov, cfg_t1=str(cfg1), us_t1=t1 * 1e6, us_t4=t4 * 1e6))
                except Exception as e:  # noqa: BLE001
                    out.append(dict(overrides=ov, error=repr(e)[:300]))
                log("refine", mode, out[-1])
                self.put("refine_T1_T4", mode, out)

    def section_table(self, copies, best=None):
        from pallas_kernels.moe import reference as ref

        for name, s in self.shapes.items():
            gu, dn = self.expert_weights(name)
            for t in self.tokens:
                if self.time_left() < 5:
                    log("budget spent: table stops at", name, t)
                    return
                sets = self.token_sets(name, t, self.sets)
                nbytes = expert_bytes(s, t)
                row = {"pairs": t * s["K"], "expert_bytes": nbytes,
                       "distinct_expert_bytes_first_set": int(len(np.unique(np.asarray(sets[0][1])))) * nbytes
                       // (t * s["K"])}
                row["pallas_us"] = self.time_fn(self.moe_fn(), sets, (gu, dn)) * 1e6
                if best:
                    row["pallas_swept_us"] = self.time_fn(self.moe_fn(best.get("up"), best.get("down")), sets,
                                                          (gu, dn)) * 1e6
                row["pallas_up_fma_us"] = self.time_fn(self.moe_fn(UP_FMA), sets, (gu, dn)) * 1e6
                row["xla_us"] = self.time_fn(ref.moe_gather, sets, (gu, dn)) * 1e6
                copy = copies.get(str(nbytes)) if isinstance(copies, dict) else None
                if copy:
                    row["copy_us"] = copy["ms"] * 1e3
                    row["copy_tb_per_s"] = copy["tb_per_s"]
                for k in ("pallas", "pallas_swept", "pallas_up_fma", "xla"):
                    if f"{k}_us" in row:
                        rate = nbytes / (row[f"{k}_us"] * 1e-6)
                        row[f"{k}_tb_per_s"] = rate / 1e12
                        if copy:
                            row[f"{k}_frac_of_copy"] = rate / (copy["tb_per_s"] * 1e12)
                row["speedup_pallas_vs_xla"] = row["xla_us"] / row["pallas_us"]
                self.put("table", f"{name}_T{t}", row)
                log("table", name, t, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels_moe_h200.json"))
    ap.add_argument("--budget-s", type=float, default=250.0)
    ap.add_argument("--reserve-s", type=float, default=90.0, help="seconds the sweep leaves for the table")
    ap.add_argument("--sweep", action="store_true", help="the launch-shape sweep that chose DEFAULTS")
    ap.add_argument("--refine", action="store_true", help="neighbours of DEFAULTS, each kernel alone")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, interpret mode, no copy")
    args = ap.parse_args()

    copies = {}
    if not args.smoke:
        sizes = [1 << 31] + sorted({expert_bytes(s, t) for s in SHAPES.values() for t in TOKENS})
        copies = copy_rates(sizes)
        log("copy", copies)
    bn = Bench(args)
    bn.res["sections"]["copy"] = copies
    if not args.smoke and "error" not in copies:
        bn.res["copy_ceiling_tb_per_s"] = copies[str(1 << 31)]["tb_per_s"]
    from pallas_kernels.moe import gather_gemv as gg

    bn.res["default_launch_shapes"] = {
        f"{name}_T{t}": {"up": str(gg.choose(t * s["K"], s["E"], 2 * s["I"], mode="up")),
                         "down": str(gg.choose(t * s["K"], s["I"], s["E"], mode="down"))}
        for name, s in bn.shapes.items() for t in bn.tokens}
    bn.save()
    bn.section_correctness()
    best = bn.section_sweep() if args.sweep else None
    if args.refine:
        bn.section_refine()
    bn.section_table(copies, best)
    log("done")


if __name__ == "__main__":
    main()
