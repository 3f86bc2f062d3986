"""Benchmark and GPU check of the expert-tiled routed-expert kernels (pallas_kernels/moe).

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 bench/kernels/moe.py --out $OUT/moe.json [--quick] [--refine] [--budget-s 170]
    PYTHONPATH=. python3 bench/kernels/moe.py --cpu-smoke --out /tmp/moe_smoke.json   # CPU: tiny, interpret

In order of priority (the time budget skips the tail, and the JSON lists what it skipped):
1. copy rates, before JAX takes the GPU: a 2 GiB device-to-device copy (the ceiling) and a copy of
   the ideal bytes of every table row (`copy_bytes`), through PyTorch in a subprocess, rotating over
   four buffer pairs; bytes read + written per second. Without PyTorch, jnp.copy under jit
   (`copy_source` says which);
2. correctness on the GPU at T=1 (one pair per tile), with skewed routing (one expert taking a
   slot of every token, so its pairs cross tile boundaries) and at Qwen3-Next T=64 (sorted tiles):
   the tiled kernels, the XLA gather path
   (`reference.moe_gather`) and the grouped GEMM (`SparseMoE._routed_grouped`) against a float32
   oracle on the gathered weights;
3. the table: Qwen3-Next (X=512, K=10, E=2048, I=512) and Qwen3-30B-A3B (X=128, K=8, E=2048,
   I=768) shapes, bf16, T in {1, 4, 8, 16, 32, 64, 128, 256, 512}, visited so that a budget cut
   loses the least (T = 1, 128, 16, 512, 32, 4, 256, 64, 8; both shapes at each). Main columns:
   - `tiled`: `moe_gather_pallas` as SparseMoE runs it (tiles of 16; sorted by expert or one pair per
     tile as `gather_gemv.sorts` decides: `default_plan` in the row says which);
   - `ragged`: XLA's grouped GEMM, the engine's own `SparseMoE._routed_grouped` (argsort + ragged_dot);
   - at T in {4, 8, 16}, the plan `tiled` did not take: `pairs` (one pair per tile, i.e. the
     per-pair kernel they replaced, which is what `tiled` runs at T=1) or `sorted`; tunes
     SORT_MIN_LOAD.
   Then, with time left (not with --quick): `tiled_m32` / `tiled_m64` (tiles of 32 / 64 pairs) at
   T >= 128, `pairs` at T in {32, 64}, `plan` (the tile planning alone: sort, scans, scatters) at T in
   {4, 16, 128, 512}, and `xla_gather` (`reference.moe_gather`, what `_routed_gather` ran before the
   kernels) at T=1.
   Bytes: `ideal_bytes` = distinct experts per routing (mean over the rotated sets) x 3 x E x I x 2,
   what any path must read; `tile_bytes` = tiles used x the same slab, what the tiled kernels ask of
   memory (repeats within ~the same moment hit L2); `pair_bytes` = pairs x slab. A path's
   `frac_of_copy` is (ideal_bytes / its time) over the (read + written) rate of a copy of
   `copy_bytes` (ideal_bytes rounded to MiB); `speedup_tiled_vs_*` are ratios of times;
4. with --refine: launch-shape neighbours of `gather_gemv.DEFAULTS` for the whole op at Qwen3-Next
   T=1 and T=128.

Timing: each measured call runs the op on R rotated input sets (tokens, random top-k routing, R = 32
for T <= 16, 8 for T <= 64, else 4) inside one jitted function, with the expert weights (3.2 GB /
1.2 GB, far above L2) as arguments; a few calls are queued before one `block_until_ready`, so host
dispatch overlaps the GPU; median of 3-9 samples (fewer for slow ops), divided by calls x R.
`compile_s` per path shows where the budget went.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
import zlib

import numpy as np

T0 = time.perf_counter()
SHAPES = {
    "qwen3_next": dict(X=512, K=10, E=2048, I=512),
    "qwen3_30b_a3b": dict(X=128, K=8, E=2048, I=768),
}
TOKENS = (1, 128, 16, 512, 32, 4, 256, 64, 8)  # priority order; the JSON keys say T
QUICK_TOKENS = (1, 128, 16, 512)
SMOKE_SHAPES = {"tiny": dict(X=16, K=4, E=64, I=48)}
SMOKE_TOKENS = (1, 12, 5)
PAIRS_T = (4, 8, 16)  # the per-pair schedule, beside the tiled one, in the table
EXTRA_PAIRS_T = (32, 64)
EXTRA_BLOCK_M = (32, 64)  # tiles taller than one MMA, where experts have many pairs
EXTRA_BLOCK_M_MIN_T = 128
PLAN_T = (4, 16, 128, 512)  # the tile planning alone

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


def f32_oracle(x, experts, weights, gate_up, down):
    """The routed experts in float32 on the gathered experts' weights (what every path is checked against)."""
    import jax
    import jax.numpy as jnp

    flat = experts.reshape(-1)
    rows = jnp.repeat(x.astype(jnp.float32), experts.shape[1], axis=0)
    hi = jax.lax.Precision.HIGHEST
    h = jnp.einsum("ne,nei->ni", rows, gate_up[flat].astype(jnp.float32), precision=hi)
    g, u = jnp.split(h, 2, axis=-1)
    y = jnp.einsum("ni,nie->ne", jax.nn.silu(g) * u, down[flat].astype(jnp.float32), precision=hi)
    y = y.reshape(*experts.shape, -1) * weights[..., None].astype(jnp.float32)
    return y.sum(1)


def slab_bytes(shape, itemsize=2):
    """One expert's gate_up + down weights."""
    return 3 * shape["E"] * shape["I"] * itemsize


def routings(shape, t, n, seed=0):
    """n random top-k routings `[T, K]` (distinct experts within a token), deterministic per T."""
    rng = np.random.default_rng(seed + 97 * t)
    return [np.argsort(rng.random((t, shape["X"])), axis=1)[:, : shape["K"]] for _ in range(n)]


def num_sets(t, smoke=False):
    if smoke:
        return 2
    return 32 if t <= 16 else 8 if t <= 64 else 4


def routing_stats(shape, t, smoke=False, block_m=16):
    """Mean over the rotated sets: distinct experts, tiles of `block_m` used; from host routings."""
    distinct, used = [], []
    for e in routings(shape, t, num_sets(t, smoke)):
        counts = np.bincount(e.reshape(-1), minlength=shape["X"])
        distinct.append(int((counts > 0).sum()))
        used.append(int(sum(-(-c // block_m) for c in counts)))
    return float(np.mean(distinct)), float(np.mean(used))


def copy_bytes(shape, t, smoke=False):
    """The size of the copy a row is compared with: its ideal bytes rounded to MiB (so that copy
    sizes are few and reproducible)."""
    b = routing_stats(shape, t, smoke)[0] * slab_bytes(shape)
    return max(1 << 20, int(round(b / (1 << 20))) << 20)


def copy_rates_torch(sizes):
    try:
        out = subprocess.run([sys.executable, "-c", COPY_SCRIPT, json.dumps(sizes)], capture_output=True, text=True,
                             timeout=150)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - report it; the JAX copy stands in
        return {"error": repr(e)[:500]}


def copy_rates_jax(sizes, reps=20, samples=7):
    """jnp.copy under jit (XLA emits a device copy): the stand-in when PyTorch is not there."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(jnp.copy)
    res = {}
    for n in sizes:
        pairs = 1 if n >= (1 << 31) else 4
        srcs = [jax.random.bits(jax.random.key(i), (n,), jnp.uint8) for i in range(pairs)]
        jax.block_until_ready([f(s) for s in srcs])
        ts = []
        for _ in range(samples):
            t = time.perf_counter()
            jax.block_until_ready([f(srcs[i % pairs]) for i in range(reps)])
            ts.append((time.perf_counter() - t) / reps)
        ms = statistics.median(ts) * 1e3
        res[str(n)] = {"ms": ms, "tb_per_s": 2 * n / ms / 1e9}
        del srcs
    return res


def git_commit():
    if os.environ.get("JSPEC_COMMIT"):  # set by whoever copied the tree to a machine without its .git
        return os.environ["JSPEC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


class Bench:
    def __init__(self, args):
        import jax

        from pallas_kernels.moe import gather_gemv as gg

        self.jax, self.gg = jax, gg
        self.args = args
        self.deadline = T0 + args.budget_s
        self.smoke = args.cpu_smoke
        self.shapes = SMOKE_SHAPES if self.smoke else SHAPES
        self.tokens = SMOKE_TOKENS if self.smoke else args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
        from jspec.models import mlp

        dev = jax.devices()[0]
        self.res = {
            "device": dev.device_kind,
            "jax_version": jax.__version__,
            "commit": git_commit(),
            "command": "PYTHONPATH=. python3 bench/kernels/moe.py " + " ".join(sys.argv[1:]),
            "timing": "median over samples of (queued jitted calls, each the op on R rotated input sets) / (calls x R)",
            "bytes": "ideal_bytes: mean distinct experts x 3 x E x I x 2 (bf16); tile_bytes: mean tiles used x the "
                     "same; pair_bytes: T*K x the same",
            "fraction": "(ideal_bytes / time) / (2 x bytes / time of a device copy of the same bytes)",
            "gather_max_tokens": mlp.GATHER_MAX_TOKENS,
            "sort_min_load": gg.SORT_MIN_LOAD,
            "skipped": [],
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

    def skip(self, what):
        self.res["skipped"].append(what)
        log("skipped (budget):", what)

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
            self.weights[name] = jax.block_until_ready((gu, dn))  # both shapes together: 4.4 GB
        return self.weights[name]

    def token_sets(self, name, t, seed=0):
        """The rotated sets of (x [T, E], experts [T, K], weights [T, K]) in bf16."""
        jnp = self.jax.numpy
        s = self.shapes[name]
        rng = np.random.default_rng(seed + 1 + 97 * t)
        sets = []
        for experts in routings(s, t, num_sets(t, self.smoke), seed):
            w = rng.random((t, s["K"]))
            w /= w.sum(1, keepdims=True)
            sets.append((jnp.asarray(rng.standard_normal((t, s["E"])), jnp.bfloat16), jnp.asarray(experts, jnp.int32),
                         jnp.asarray(w, jnp.bfloat16)))
        return sets

    # ------------------------------------------------------------------------- paths

    def tiled_fn(self, *, block_m=16, sort=None, up=None, down=None, single_row=True):
        gg = self.gg

        def fn(x, experts, weights, gate_up, down_w):
            up_cfg = down_cfg = None
            if up or down:  # launch-shape overrides: `choose` needs the plan's tile count
                t, k = experts.shape
                srt = gg.sorts(t, k, gate_up.shape[0]) if sort is None else sort
                nt = gg.tiles.max_tiles(t * k, gate_up.shape[0], block_m) if srt else t * k
                up_cfg = gg.choose(nt, x.shape[1], gate_up.shape[2], mode="up", **(up or {}))
                down_cfg = gg.choose(nt, down_w.shape[1], down_w.shape[2], mode="down_sorted" if srt else "down",
                                     **(down or {}))
            return gg.moe_gather_pallas(x, experts, weights, gate_up, down_w, block_m=block_m, sort=sort,
                                        up_cfg=up_cfg, down_cfg=down_cfg, interpret=self.smoke,
                                        single_row=single_row)

        return fn

    @staticmethod
    def ragged_fn(x, experts, weights, gate_up, down_w):
        """The engine's grouped path, `SparseMoE._routed_grouped`, on bare arrays (its `self` is a stand-in)."""
        from jspec.models.mlp import SparseMoE

        me = types.SimpleNamespace(top_k=experts.shape[1], num_experts=gate_up.shape[0],
                                   intermediate=down_w.shape[1], expert_layout_tp=1,
                                   experts=types.SimpleNamespace(gate_up_proj=gate_up, down_proj=down_w))
        return SparseMoE._routed_grouped(me, x, experts, weights)

    def plan_fn(self):
        gg = self.gg
        return lambda x, experts, weights, gate_up, down_w: gg.plan(experts, gate_up.shape[0], sort=True)

    # ------------------------------------------------------------------------- timing

    def time_fn(self, fn, sets, weights):
        """(seconds per op, seconds to compile): fn(*set, *weights) over the rotated sets inside one jit."""
        jax = self.jax
        f = jax.jit(lambda sets, weights: [fn(*s, *weights) for s in sets])
        t = time.perf_counter()
        jax.block_until_ready(f(sets, weights))
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready(f(sets, weights))
        one = time.perf_counter() - t
        if self.smoke:
            return one / len(sets), compile_s
        calls = 5 if one < 0.02 else 2 if one < 0.1 else 1
        samples = max(3, min(9, int(0.4 / (one * calls))))
        ts = []
        for _ in range(samples):
            t = time.perf_counter()
            jax.block_until_ready([f(sets, weights) for _ in range(calls)])
            ts.append((time.perf_counter() - t) / (calls * len(sets)))
        return statistics.median(ts), compile_s

    def measure(self, row, key, fn, sets, weights, *, need_s=6.0):
        """row[key_us] (and key_compile_s), or key_error; False when the budget is spent."""
        if self.time_left() < need_s:
            return False
        try:
            sec, comp = self.time_fn(fn, sets, weights)
            row[f"{key}_us"] = sec * 1e6
            row[f"{key}_compile_s"] = round(comp, 2)
        except Exception as e:  # noqa: BLE001 - an OOM or a lowering failure: record it, go on
            row[f"{key}_error"] = repr(e)[:400]
        return True

    # ------------------------------------------------------------------------- sections

    def section_correctness(self):
        oracle = f32_oracle

        def rel(a, b):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

        # T=1: one pair per tile. Skewed: every token's first slot on expert 0 (24 / 32 pairs on it,
        # across tiles of 16) and the last token a repeat of the first. Qwen3-Next T=64: sorted tiles
        # (1.25 pairs per expert), with the down kernel's sorted-tile launch shapes.
        if self.smoke:
            cases = [("tiny", 1, False), ("tiny", 12, True)]
        else:
            cases = [("qwen3_next", 1, False), ("qwen3_next", 24, True), ("qwen3_next", 64, False),
                     ("qwen3_30b_a3b", 32, True)]
        ok = True
        for name, t, skewed in cases:
            if self.time_left() < 20:
                self.skip(f"correctness {name} T{t}")
                continue
            try:
                row = self.correctness_case(name, t, skewed, oracle, rel)
            except Exception as e:  # noqa: BLE001 - a lowering failure: record it; the table still runs
                row = {"ok": False, "error": repr(e)[:600]}
            ok &= row["ok"]
            self.put("correctness", f"{name}_T{t}", row)
            log("correctness", name, t, row)
        self.put("correctness", "all_ok", ok)
        return ok

    def correctness_case(self, name, t, skewed, oracle, rel):
        jax, jnp = self.jax, self.jax.numpy
        from pallas_kernels.moe import reference as ref

        gu, dn = self.expert_weights(name)
        (x, _, w), *_ = self.token_sets(name, t, seed=1)
        e = routings(self.shapes[name], t, 1, seed=1)[0]
        if skewed:
            for r in e:  # expert 0 into slot 0, keeping a token's experts distinct
                r[r == 0] = r[0]
                r[0] = 0
            e[-1] = e[0]
        e = jnp.asarray(e, jnp.int32)
        o = jax.jit(oracle)(x, e, w, gu, dn)
        row = {"skewed": skewed, "max_abs_out": float(jnp.max(jnp.abs(o)))}
        tiled = None
        for key, fn in (("tiled", self.tiled_fn()), ("xla_gather", ref.moe_gather), ("ragged", self.ragged_fn)):
            out = jax.jit(fn)(x, e, w, gu, dn).astype(jnp.float32)
            row[f"{key}_vs_f32_rel_l2"] = rel(out, o)
            row[f"{key}_finite"] = bool(jnp.all(jnp.isfinite(out)))
            if tiled is None:
                tiled = out
            else:
                row[f"tiled_vs_{key}_rel_l2"] = rel(tiled, out)
        row["ok"] = row["tiled_finite"] and row["tiled_vs_f32_rel_l2"] <= 2 * row["xla_gather_vs_f32_rel_l2"] + 1e-3
        return row

    def section_table(self, copies):
        """The main rows for every T (priority order, both shapes), then the extras while time is left."""
        from pallas_kernels.moe import reference as ref

        main, extra = [], []  # (name, t, key, fn)
        for t in self.tokens:
            for name in self.shapes:
                main.append((name, t, "tiled", self.tiled_fn()))
                main.append((name, t, "ragged", self.ragged_fn))
                if not self.gg.sorts(t, self.shapes[name]["K"], self.shapes[name]["X"]):
                    # One pair per tile: the single-vector load against the generic masked row gather.
                    main.append((name, t, "masked_rows", self.tiled_fn(single_row=False)))
                if t in PAIRS_T or (self.smoke and t > 1):  # the plan the default did not take
                    srt = not self.gg.sorts(t, self.shapes[name]["K"], self.shapes[name]["X"])
                    main.append((name, t, "sorted" if srt else "pairs", self.tiled_fn(sort=srt)))
                if t >= EXTRA_BLOCK_M_MIN_T or (self.smoke and t > 1):
                    extra += [(name, t, f"tiled_m{bm}", self.tiled_fn(block_m=bm)) for bm in EXTRA_BLOCK_M]
                if t in EXTRA_PAIRS_T:
                    extra.append((name, t, "pairs", self.tiled_fn(sort=False)))
                if t in PLAN_T or (self.smoke and t > 1):
                    extra.append((name, t, "plan", self.plan_fn()))
                if t == 1:
                    extra.append((name, t, "xla_gather", ref.moe_gather))
        rows, sets = {}, {}
        for name, t, key, fn in main + ([] if self.args.quick else extra):
            if (name, t) not in rows:
                rows[(name, t)] = self.table_row(name, t, copies)
            row = rows[(name, t)]
            if (name, t) not in sets:
                sets.clear()  # one row's input sets at a time
                sets[(name, t)] = self.token_sets(name, t)
            if not self.measure(row, key, fn, sets[(name, t)], self.expert_weights(name),
                                need_s=4.0 if key == "plan" else 8.0):
                self.skip(f"table {name} T{t} {key}")
                continue
            if f"{key}_us" in row and key != "plan":
                rate = row["ideal_bytes"] / (row[f"{key}_us"] * 1e-6)
                row[f"{key}_tb_per_s"] = rate / 1e12
                if "copy_tb_per_s" in row:
                    row[f"{key}_frac_of_copy"] = rate / (row["copy_tb_per_s"] * 1e12)
            for other in ("ragged", "pairs", "sorted"):
                if "tiled_us" in row and f"{other}_us" in row:
                    row[f"speedup_tiled_vs_{other}"] = row[f"{other}_us"] / row["tiled_us"]
            self.put("table", f"{name}_T{t}", row)
            log("table", name, t, key, {k: round(v, 3) for k, v in row.items() if k.startswith(key)
                                        and isinstance(v, float)})

    def table_row(self, name, t, copies):
        s = self.shapes[name]
        distinct, used = routing_stats(s, t, self.smoke)
        nbytes = copy_bytes(s, t, self.smoke)
        tiles, slab = self._tiles(s, t), slab_bytes(s)
        plan = "sorted" if self.gg.sorts(t, s["K"], s["X"]) else "pairs"
        row = {"T": t, "num_pairs": t * s["K"], "default_plan": plan,
               "sets": num_sets(t, self.smoke), "distinct_experts": distinct, "tiles_used": used,
               "ideal_bytes": int(distinct * slab), "copy_bytes": nbytes, "tile_bytes": int(used * slab),
               "pair_bytes": t * s["K"] * slab, "num_tiles": tiles,
               "launch_up": str(self.gg.choose(tiles, s["E"], 2 * s["I"], mode="up")),
               "launch_down": str(self.gg.choose(tiles, s["I"], s["E"],
                                                 mode="down_sorted" if plan == "sorted" else "down"))}
        copy = copies.get(str(nbytes))
        if copy:
            row["copy_us"] = copy["ms"] * 1e3
            row["copy_tb_per_s"] = copy["tb_per_s"]
        return row

    def _tiles(self, s, t, block_m=16):
        srt = self.gg.sorts(t, s["K"], s["X"])
        return self.gg.tiles.max_tiles(t * s["K"], s["X"], block_m) if srt else t * s["K"]

    def section_refine(self):
        """Neighbours of the defaults for the whole op (Qwen3-Next T=1 and T=128)."""
        name = next(iter(self.shapes))
        gu, dn = self.expert_weights(name)
        variants = [({}, {}), (dict(programs_per_sm=4), {}), ({}, dict(programs_per_sm=4)), (dict(block_n=128), {}),
                    ({}, dict(block_n=256)), (dict(num_warps=8), dict(num_warps=8)), (dict(block_k=32), {}),
                    ({}, dict(block_k=128)), (dict(num_stages=4), dict(num_stages=4))]
        out = []
        for up, down in variants:
            row = {"up": up, "down": down}
            for t in (1, 128) if not self.smoke else (1, 12):
                sets = self.token_sets(name, t)
                if not self.measure(row, f"T{t}", self.tiled_fn(up=up, down=down), sets, (gu, dn)):
                    self.skip(f"refine {up} {down} T{t}")
            out.append(row)
            log("refine", row)
            self.put("refine", name, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe.json"))
    ap.add_argument("--budget-s", type=float, default=170.0, help="wall seconds for the whole run")
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS}, main rows only")
    ap.add_argument("--refine", action="store_true", help="launch-shape neighbours of DEFAULTS (after the table)")
    ap.add_argument("--cpu-smoke", "--smoke", dest="cpu_smoke", action="store_true",
                    help="CPU: tiny shapes, kernels in interpret mode, a JAX copy; checks the script, not speed")
    ap.add_argument("--tokens", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                    help="T values to visit, in this order (default: all, or --quick's)")
    args = ap.parse_args()

    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    tokens = SMOKE_TOKENS if args.cpu_smoke else args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    sizes = sorted({copy_bytes(s, t, args.cpu_smoke) for s in shapes.values() for t in tokens})
    copies, source = {}, "torch"
    if not args.cpu_smoke:
        copies = copy_rates_torch([1 << 31] + sizes)
        log("copy (torch)", copies)
    if args.cpu_smoke or "error" in copies:
        torch_error = copies.get("error")
        source = "jax"
        copies = copy_rates_jax(sizes + ([] if args.cpu_smoke else [1 << 31]))
        if torch_error:
            copies["torch_error"] = torch_error
        log("copy (jax)", copies)
    bn = Bench(args)
    bn.res["copy_source"] = source
    bn.res["sections"]["copy"] = copies
    if str(1 << 31) in copies:
        bn.res["copy_ceiling_tb_per_s"] = copies[str(1 << 31)]["tb_per_s"]
    bn.save()
    bn.section_correctness()
    bn.section_table(copies)
    if args.refine:
        bn.section_refine()
    bn.res["wall_s"] = round(time.perf_counter() - T0, 1)
    bn.save()
    log("done")


if __name__ == "__main__":
    main()
