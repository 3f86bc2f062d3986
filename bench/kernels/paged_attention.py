"""Benchmark and GPU check of the Pallas paged-attention kernels (pallas_kernels/paged_attention).

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 bench/kernels/paged_attention.py --out bench/results/kernels_paged_attention_<dev>.json

What it does, in order of priority (a time budget skips the tail rather than lose everything):
1. copy ceiling: a 2 GiB device-to-device copy through PyTorch (in a subprocess, before JAX
   takes the GPU), bytes read + written per second;
2. correctness on the GPU: every public function against `reference.py` on NaN-poisoned pools
   (bf16, plus one fp32 case), relative L2 error and finiteness;
3. decode at B=32, ctx=4096, Qwen3-8B heads: ours (default and a launch-shape sweep), JAX's
   `pallas.ops.gpu.paged_attention`, XLA (the jnp reference), as a fraction of the copy rate;
4. verify N=4/8 (tree and linear chain) and a DFlash block, relative to decode;
5. causal prefill 8k: ours vs cuDNN (`jax.nn.dot_product_attention`) and JAX's Pallas ops;
6. KV write: the Pallas scatter vs XLA's, both donated;
7. the decode grid (batch 1..256, context 512..32k, Qwen3-8B and Qwen3-Next heads).

Timing: every measured call runs R times inside one jitted function on R rotated input sets
(so no host work sits between kernels and small working sets do not stay in L2), timed with
`block_until_ready`, median of repeats, divided by R. Decode bandwidth counts the K and V bytes
the requests own (2 x sum(seq_lens) x G x D x itemsize).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

COPY_SCRIPT = r"""
import json, torch
n = 1 << 30  # bf16 elements: 2 GiB each way
src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)
torch.cuda.synchronize()
ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); dst.copy_(src); b.record(); b.synchronize()
    ts.append(a.elapsed_time(b))
ms = sorted(ts)[len(ts) // 2]
print(json.dumps({"bytes_read_plus_written": 4 * n, "ms": ms, "tb_per_s": 4 * n / ms / 1e9}))
"""

T0 = time.perf_counter()
QWEN3_8B = dict(H=32, G=8, D=128)
QWEN3_NEXT = dict(H=16, G=2, D=256)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def copy_bandwidth():
    try:
        out = subprocess.run([sys.executable, "-c", COPY_SCRIPT], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - report, fall back below
        return {"error": repr(e)[:500]}


def git_commit():
    if os.environ.get("JSPEC_COMMIT"):
        return os.environ["JSPEC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "uncommitted"


class Bench:
    def __init__(self, out_path, budget_s):
        import jax

        self.jax = jax
        self.out_path = out_path
        self.deadline = T0 + budget_s
        self.reserve = 0.0  # seconds a section leaves for the sections after it
        dev = jax.devices()[0]
        self.res = {
            "device": dev.device_kind,
            "jax_version": jax.__version__,
            "commit": git_commit(),
            "command": "PYTHONPATH=. python3 bench/kernels/paged_attention.py " + " ".join(sys.argv[1:]),
            "timing": "median wall time of a jitted call running the op R times on rotated inputs, / R",
            "sections": {},
        }

    def time_left(self):
        return self.deadline - time.perf_counter()

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.out_path)), exist_ok=True)
        with open(self.out_path, "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    def put(self, section, key, value):
        self.res["sections"].setdefault(section, {})[key] = value
        self.save()

    def time_fn(self, fn, arg_sets, *, reps=7, min_s=0.15):
        """Seconds per call of fn(*args), args rotating over arg_sets inside one jit."""
        jax = self.jax
        f = jax.jit(lambda sets: [fn(*a) for a in sets])
        jax.block_until_ready(f(arg_sets))
        jax.block_until_ready(f(arg_sets))
        ts, stop = [], time.perf_counter() + min_s
        while len(ts) < reps or (time.perf_counter() < stop and len(ts) < 60):
            t = time.perf_counter()
            jax.block_until_ready(f(arg_sets))
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) / len(arg_sets)


# ----------------------------------------------------------------------------- inputs


def poisoned_case(rng, q_lens, prefixes, *, T, L, H, G, D, dtype, extra_pages=7):
    """A ragged step on a NaN-poisoned pool (every slot no request owns is NaN)."""
    import jax.numpy as jnp

    q_lens = np.asarray(q_lens, np.int32)
    seq = np.asarray(prefixes, np.int32) + q_lens
    B = len(q_lens)
    Pmax = int(max(1, (-(-seq // L)).max()))
    P = B * Pmax + extra_pages
    pages = rng.permutation(np.arange(1, P))
    pt = rng.integers(0, P, size=(B, Pmax)).astype(np.int32)
    k = np.full((P, L, G, D), np.nan, np.float32)
    v = np.full((P, L, G, D), np.nan, np.float32)
    for b in range(B):
        n = -(-seq[b] // L)
        own = pages[b * Pmax: b * Pmax + n]
        pt[b, :n] = own
        kk = rng.standard_normal((n * L, G, D)).astype(np.float32)
        vv = rng.standard_normal((n * L, G, D)).astype(np.float32)
        kk[seq[b]:] = np.nan
        vv[seq[b]:] = np.nan
        k[own] = kk.reshape(n, L, G, D)
        v[own] = vv.reshape(n, L, G, D)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    q[cu[-1]:] = np.nan
    c = lambda x: jnp.asarray(x, dtype)
    return c(q), c(k), c(v), jnp.asarray(pt), jnp.asarray(seq), jnp.asarray(cu)


def random_tree(rng, B, N):
    mask = np.zeros((B, N, N), bool)
    for b in range(B):
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, N)]
        for j in range(N):
            a = j
            while a >= 0:
                mask[b, j, a] = True
                a = parent[a]
    return mask


def paged_pool(key, *, B, pages_per_seq, n_sets, L, G, D, dtype):
    """Random pool with n_sets disjoint page sets of B x pages_per_seq pages (page 0 spare)."""
    import jax
    import jax.numpy as jnp

    P = n_sets * B * pages_per_seq + 1
    kk, kv = jax.random.split(key)
    k = jax.random.normal(kk, (P, L, G, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (P, L, G, D), jnp.float32).astype(dtype)
    rng = np.random.default_rng(0)
    tables = []
    for s in range(n_sets):
        pages = 1 + s * B * pages_per_seq + rng.permutation(B * pages_per_seq)
        tables.append(jnp.asarray(pages.reshape(B, pages_per_seq).astype(np.int32)))
    return k, v, tables


def n_rotations(bytes_per_call, l2_bytes=50e6):
    """Input sets to cycle so that one pass over them is 4x the L2 (at most 32), and calls per
    timed launch (at least 8, so the launch and sync overhead is spread thin)."""
    sets = int(min(32, max(1, math.ceil(4 * l2_bytes / max(bytes_per_call, 1)))))
    return sets, max(8, sets)


# ----------------------------------------------------------------------------- sections


def section_correctness(bn, cases=("qwen3_8b_bf16", "qwen3_next_bf16", "qwen3_8b_f32")):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import paged_attention as pa
    from pallas_kernels.paged_attention import reference as ref

    rng = np.random.default_rng(1)
    scale = 0.088
    out = {}

    def rel(a, b):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        b = np.asarray(jnp.asarray(b, jnp.float32))
        return {"rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
                "finite": bool(np.isfinite(a).all())}

    up = lambda args: [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
    for name, heads, dtype in [("qwen3_8b_bf16", QWEN3_8B, jnp.bfloat16), ("qwen3_next_bf16", QWEN3_NEXT, jnp.bfloat16),
                               ("qwen3_8b_f32", QWEN3_8B, jnp.float32)]:
        if bn.time_left() < bn.reserve + 30:
            break
        if name not in cases:
            continue
        L = 16
        # ragged: zero-length, single-token, page crossings, a long chunk over a long prefix
        args = poisoned_case(rng, [37, 0, 1, 5, 130], [100, 0, 15, 16, 300], T=192, L=L, dtype=dtype, **heads)
        T = args[0].shape[0]
        for mode in ("causal", "full"):
            f = jax.jit(functools.partial(pa.paged_attention, sm_scale=scale, mask_mode=mode))
            r = jax.jit(functools.partial(ref.paged_attention, sm_scale=scale, mask_mode=mode))(*up(args))
            o = f(*args)
            pad_zero = bool((np.asarray(o[173:], np.float32) == 0).all())  # tokens past cu_q_lens[B] = 173
            out[f"{name}/extend_{mode}"] = rel(o, r) | {"padding_zero": pad_zero}
        for N in (4, 8, 40):
            tq = [N, N, 0, N]
            targs = poisoned_case(rng, tq, [50, 0, 0, 401], T=4 * N + 3, L=L, dtype=dtype, **heads)
            mask = jnp.asarray(random_tree(rng, 4, N))
            f = jax.jit(functools.partial(pa.paged_attention, sm_scale=scale, mask_mode="tree"))
            o = f(*targs, custom_mask=mask)
            r = jax.jit(functools.partial(ref.paged_attention, sm_scale=scale, mask_mode="tree"))(
                *up(targs), custom_mask=mask)
            out[f"{name}/tree_N{N}"] = rel(o, r)
        dargs = poisoned_case(rng, [1, 1, 0, 1, 1], [0, 15, 0, 700, 4095], T=5, L=L, dtype=dtype, **heads)
        q, k, v, pt, seq, _ = dargs
        q = jnp.asarray(rng.standard_normal(q.shape), dtype)
        o = jax.jit(functools.partial(pa.paged_decode, sm_scale=scale))(q, k, v, pt, seq)
        r = jax.jit(functools.partial(ref.paged_decode, sm_scale=scale))(*up([q, k, v, pt, seq]))
        out[f"{name}/decode"] = rel(o, r)
        # KV write: bit-exact against XLA's scatter, pads skipped, NaN slots untouched
        slots = jnp.asarray(np.where(rng.random(T) < 0.2, -1, rng.permutation(k.shape[0] * L)[:T]), jnp.int32)
        kn = jnp.asarray(rng.standard_normal((T,) + k.shape[2:]), dtype)
        mine = jax.jit(pa.write_kv)(k, v, kn, kn, slots)
        theirs = jax.jit(ref.write_kv)(k, v, kn, kn, slots)
        out[f"{name}/write_kv_exact"] = all(
            np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), equal_nan=True)
            for a, b in zip(mine, theirs))
        bn.put("correctness", "results", out)
        log("correctness", name, {k_: v_ for k_, v_ in out.items() if k_.startswith(name)})
    ok = all((v_ is True) or (isinstance(v_, dict) and v_["finite"] and v_["rel_l2"] < 2e-2
                               and v_.get("padding_zero", True)) for v_ in out.values())
    bn.put("correctness", "all_ok", ok)


def decode_case(bn, *, B, ctx, H, G, D, L=16, dtype_name="bfloat16", tuned=None, peers=(), impl="public"):
    """Time our decode (and peers) at one shape; return a dict of figures.

    impl: "public" (`paged_decode`), "tuned" (`paged_decode_tuned` with `tuned` launch shapes) or
    "kernel_only" (the Pallas call alone, without the XLA split merge: a diagnostic)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import reference as ref
    from pallas_kernels.paged_attention import paged_decode
    from pallas_kernels.paged_attention.attention import paged_decode_tuned
    from pallas_kernels.paged_attention.kernel import attention_blocks, choose

    dtype = jnp.dtype(dtype_name)
    pps = ctx // L
    kv_bytes = 2 * B * ctx * G * D * dtype.itemsize
    n_sets, R = n_rotations(kv_bytes)
    k, v, tables = paged_pool(jax.random.key(B * 7 + ctx), B=B, pages_per_seq=pps, n_sets=n_sets, L=L, G=G, D=D,
                              dtype=dtype)
    seq = jnp.full((B,), ctx, jnp.int32)
    qs = [jax.random.normal(jax.random.key(i), (B, H, D), jnp.float32).astype(dtype) for i in range(n_sets)]
    sets = [(qs[i % n_sets], k, v, tables[i % n_sets], seq) for i in range(R)]
    scale = 1 / math.sqrt(D)
    copy = bn.res.get("copy_tb_per_s")
    res = {"B": B, "ctx": ctx, "H": H, "G": G, "D": D, "L": L, "kv_bytes": kv_bytes, "rotations": R, "impl": impl}
    tuned = tuned or {}
    cfg = choose(num_blocks=B, block_q=1, group=H // G, num_kv_heads=G, head_dim=D, page_size=L,
                 pages_per_seq=pps, **tuned)
    res["config"] = cfg.__dict__  # what paged_decode_tuned picks (paged_decode when tuned is empty)

    def kernel_only(q, kk, vv, pt, sl):
        blk = jnp.arange(B, dtype=jnp.int32)
        return attention_blocks(q, kk, vv, pt, sl, jnp.arange(B + 1, dtype=jnp.int32), blk, jnp.zeros_like(blk),
                                jnp.zeros((1, 1, 1), jnp.int32), mode="causal", cfg=cfg, sm_scale=scale,
                                interpret=False)

    fn = {"public": functools.partial(paged_decode, sm_scale=scale),
          "tuned": functools.partial(paged_decode_tuned, sm_scale=scale, **tuned),
          "kernel_only": kernel_only}[impl]
    t = bn.time_fn(fn, sets)
    res["ours_ms"] = t * 1e3
    res["ours_tb_per_s"] = kv_bytes / t / 1e12
    if copy:
        res["ours_frac_of_copy"] = res["ours_tb_per_s"] / copy
    if "jax" in peers:
        try:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_pa

            kj, vj = jnp.transpose(k, (2, 0, 1, 3)), jnp.transpose(v, (2, 0, 1, 3))
            jsets = [(a[0], kj, vj, a[3], a[4]) for a in sets]
            tj = bn.time_fn(lambda q, kk, vv, pt, sl: jax_pa(q * scale, kk, vv, pt, sl), jsets)
            res["jax_pallas_ms"] = tj * 1e3
            res["jax_pallas_frac_of_copy"] = kv_bytes / tj / 1e12 / copy if copy else None
            del kj, vj
        except Exception as e:  # noqa: BLE001
            res["jax_pallas_error"] = repr(e)[:300]
    if "xla" in peers:
        try:
            tx = bn.time_fn(functools.partial(ref.paged_decode, sm_scale=scale), sets[:4])
            res["xla_ms"] = tx * 1e3
            res["xla_frac_of_copy"] = kv_bytes / tx / 1e12 / copy if copy else None
        except Exception as e:  # noqa: BLE001
            res["xla_error"] = repr(e)[:300]
    del k, v
    return res


# The default first (with peers), then diagnostics: the kernel without the split merge, and
# how splits and pipelining depth move the time.
DECODE_SWEEP = [("public", {}), ("kernel_only", {}), ("tuned", dict(splits=1)), ("tuned", dict(splits=2)),
                ("tuned", dict(splits=8)), ("tuned", dict(num_stages=3)), ("tuned", dict(block_kv=32)),
                ("tuned", dict(block_kv=128, num_stages=3))]


def section_decode_target(bn, sweep=DECODE_SWEEP):
    rows = []
    for i, (impl, tuned) in enumerate(sweep):
        if bn.time_left() < bn.reserve + 10:
            break
        try:
            r = decode_case(bn, B=32, ctx=4096, **QWEN3_8B, tuned=tuned, impl=impl,
                            peers=("jax", "xla") if i == 0 else ())
        except Exception as e:  # noqa: BLE001
            r = {"impl": impl, "error": repr(e)[:400]}
        r["tuned"] = tuned
        rows.append(r)
        bn.put("decode_b32_ctx4096_qwen3_8b", "sweep", rows)
        log("decode target", impl, tuned, {k: r.get(k) for k in ("ours_ms", "ours_frac_of_copy", "jax_pallas_ms",
                                                                 "xla_ms", "error")})


def section_verify(bn, points=((32, 4096),)):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import paged_attention as pa

    rows = bn.res["sections"].setdefault("verify", {}).get("rows", [])
    for B, ctx in points:
        for N, mode in ((4, "tree"), (8, "tree"), (4, "causal"), (8, "causal"), (16, "full")):
            if bn.time_left() < bn.reserve + 10:
                return
            H, G, D, L = QWEN3_8B["H"], QWEN3_8B["G"], QWEN3_8B["D"], 16
            dtype = jnp.bfloat16
            pps = -(-(ctx + N) // L)
            kv_bytes = 2 * B * (ctx + N) * G * D * 2
            n_sets, R = n_rotations(kv_bytes)
            try:
                k, v, tables = paged_pool(jax.random.key(5), B=B, pages_per_seq=pps, n_sets=n_sets, L=L, G=G, D=D,
                                          dtype=dtype)
                T = B * N
                cu = jnp.arange(B + 1, dtype=jnp.int32) * N
                seq = jnp.full((B,), ctx + N, jnp.int32)
                mask = jnp.asarray(random_tree(np.random.default_rng(0), B, N))
                qs = [jax.random.normal(jax.random.key(i), (T, H, D), jnp.float32).astype(dtype) for i in range(n_sets)]
                sets = [(qs[i % n_sets], k, v, tables[i % n_sets], seq, cu, mask) for i in range(R)]
                fn = lambda q, kk, vv, pt, sl, c, m: pa.paged_attention(q, kk, vv, pt, sl, c, sm_scale=0.088,
                                                                        mask_mode=mode, custom_mask=m)
                t = bn.time_fn(fn, sets)
                dq = [jax.random.normal(jax.random.key(i), (B, H, D), jnp.float32).astype(dtype) for i in range(n_sets)]
                dsets = [(dq[i % n_sets], k, v, tables[i % n_sets], jnp.full((B,), ctx, jnp.int32)) for i in range(R)]
                td = bn.time_fn(functools.partial(pa.paged_decode, sm_scale=0.088), dsets)
                r = {"B": B, "ctx": ctx, "N": N, "mode": mode, "ms": t * 1e3, "decode_ms": td * 1e3,
                     "ratio_to_decode": t / td}
                del k, v
            except Exception as e:  # noqa: BLE001
                r = {"B": B, "ctx": ctx, "N": N, "mode": mode, "error": repr(e)[:400]}
            rows.append(r)
            bn.put("verify", "rows", rows)
            log("verify", r)


def section_prefill(bn, heads=QWEN3_8B, T=8192, sweep=True, key="prefill_8k_qwen3_8b"):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention.attention import paged_attention_tuned

    H, G, D, L = heads["H"], heads["G"], heads["D"], 16
    dtype = jnp.bfloat16
    scale = 1 / math.sqrt(D)
    k, v, tables = paged_pool(jax.random.key(3), B=1, pages_per_seq=T // L, n_sets=1, L=L, G=G, D=D, dtype=dtype)
    pt = tables[0]
    q = jax.random.normal(jax.random.key(4), (T, H, D), jnp.float32).astype(dtype)
    seq = jnp.asarray([T], jnp.int32)
    cu = jnp.asarray([0, T], jnp.int32)
    kc = k[pt[0]].reshape(T, G, D)
    vc = v[pt[0]].reshape(T, G, D)
    flops = 4 * H * D * T * (T + 1) / 2  # causal: each query sees its prefix
    out = {"T": T, "H": H, "G": G, "D": D, "flops_causal": flops}
    sets = [(q, k, v, pt, seq, cu)] * 4

    def record(name, fn, s):
        if bn.time_left() < bn.reserve + 5:
            return
        try:
            t = bn.time_fn(fn, s, reps=5, min_s=0.1)
            out[name] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": repr(e)[:400]}
        bn.put(key, "results", out)
        log("prefill", name, out[name])

    configs = [dict()]
    if sweep:  # the default is block_q=32 (128 rows), block_kv=64, 4 warps, 3 stages for these heads
        configs += [dict(num_stages=2), dict(num_warps=8), dict(block_q=16), dict(block_q=64, num_warps=8),
                    dict(block_kv=128), dict(block_kv=32)]
    for c in configs:
        fn = functools.partial(paged_attention_tuned, sm_scale=scale, mask_mode="causal", **c)
        record("ours" + ("" if not c else "_" + "_".join(f"{a}{b}" for a, b in c.items())), fn, sets)
    csets = [(q[None], kc[None], vc[None])] * 4
    record("cudnn", lambda a, b, c: jax.nn.dot_product_attention(a, b, c, scale=scale, is_causal=True,
                                                                 implementation="cudnn"), csets)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as amg

        cfg = amg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        hsets = [tuple(x.astype(jnp.float16) for x in s) for s in csets]  # that kernel takes f16 only
        record("jax_pallas_mosaic_attention_f16", lambda a, b, c: amg.attention(a, b, c, cfg), hsets)
    except Exception as e:  # noqa: BLE001
        out["jax_pallas_mosaic_attention"] = {"error": repr(e)[:400]}
    try:
        from jax.experimental.pallas.ops.gpu import attention as atr

        rep = H // G
        rsets = [(q[None], jnp.repeat(kc, rep, 1)[None], jnp.repeat(vc, rep, 1)[None])] * 4
        record("jax_pallas_triton_mha", lambda a, b, c: atr.mha(a, b, c, None, sm_scale=scale, causal=True), rsets)
    except Exception as e:  # noqa: BLE001
        out["jax_pallas_triton_mha"] = {"error": repr(e)[:400]}
    bn.put(key, "results", out)


def section_write_kv(bn, P=4096, sizes=(32, 256, 4096)):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import reference as ref
    from pallas_kernels.paged_attention.write_kv import write_kv

    L, G, D = 16, 8, 128
    rows = []
    for T in sizes:
        if bn.time_left() < bn.reserve + 5:
            break
        r = {"T": T, "pool": [P, L, G, D]}
        for name, impl in (("pallas", write_kv), ("xla", ref.write_kv)):
            R = 8
            rng = np.random.default_rng(T)
            kn = [jax.random.normal(jax.random.key(i), (T, G, D), jnp.float32).astype(jnp.bfloat16) for i in range(R)]
            sl = [jnp.asarray(np.where(rng.random(T) < 0.05, -1, rng.permutation(P * L)[:T]), jnp.int32)
                  for _ in range(R)]

            def chain(kp, vp, kn, sl):
                for a, s in zip(kn, sl):
                    kp, vp = impl(kp, vp, a, a, s)
                return kp, vp

            f = jax.jit(chain, donate_argnums=(0, 1))
            kp = jax.random.normal(jax.random.key(9), (P, L, G, D), jnp.float32).astype(jnp.bfloat16)
            vp = kp + 1
            try:
                for _ in range(2):
                    kp, vp = jax.block_until_ready(f(kp, vp, kn, sl))
                ts = []
                for _ in range(15):
                    t = time.perf_counter()
                    kp, vp = jax.block_until_ready(f(kp, vp, kn, sl))
                    ts.append(time.perf_counter() - t)
                r[f"{name}_us"] = statistics.median(ts) / R * 1e6
            except Exception as e:  # noqa: BLE001
                r[f"{name}_error"] = repr(e)[:400]
        rows.append(r)
        bn.put("write_kv", "rows", rows)
        log("write_kv", r)


def section_decode_grid(bn, impls=("public",), contexts=(512, 4096, 32768), key="decode_grid"):
    rows = []
    grid = [(QWEN3_8B, B, ctx) for B in (1, 8, 32, 128, 256) for ctx in contexts if B * ctx <= (1 << 20)]
    grid += [(QWEN3_NEXT, B, ctx) for B in (1, 32, 256) for ctx in contexts if B * ctx <= (1 << 20)]
    for heads, B, ctx in grid:
        for impl in impls:
            if bn.time_left() < bn.reserve + 10:
                return
            peers = ("jax",) if (B, ctx) in ((1, 4096), (128, 4096), (32, 32768)) and heads is QWEN3_8B else ()
            try:
                r = decode_case(bn, B=B, ctx=ctx, **heads, peers=peers if impl == impls[0] else (), impl=impl)
            except Exception as e:  # noqa: BLE001
                r = {"B": B, "ctx": ctx, **heads, "impl": impl, "error": repr(e)[:400]}
            rows.append(r)
            bn.put(key, "rows", rows)
            log("decode", {k: r.get(k) for k in ("impl", "B", "ctx", "H", "D", "ours_ms", "ours_frac_of_copy",
                                                "jax_pallas_ms", "error")})


SECTIONS = ["correctness", "decode_target", "verify", "prefill", "write_kv", "decode_grid", "verify_more",
            "prefill_next"]
# Rough seconds each section needs on the GPU (compiles included), so that an early section
# stops in time for the later ones instead of starving them.
SECTION_COST = {"correctness": 100, "decode_target": 15, "verify": 15, "prefill": 15, "write_kv": 5,
                "decode_grid": 30, "verify_more": 30, "prefill_next": 5}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/kernels_paged_attention.json")
    p.add_argument("--budget-s", type=float, default=280.0, help="stop starting new measurements after this")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweeps")
    p.add_argument("--correctness-cases", default="qwen3_8b_bf16,qwen3_next_bf16,qwen3_8b_f32")
    a = p.parse_args(argv)
    copy = copy_bandwidth()  # before JAX claims the GPU's memory
    bn = Bench(a.out, a.budget_s)
    bn.res["copy_reference"] = copy
    bn.res["copy_tb_per_s"] = copy.get("tb_per_s")
    log("device", bn.res["device"], "jax", bn.res["jax_version"], "copy", copy)
    bn.save()
    chosen = a.sections.split(",")
    steps = {
        "correctness": lambda: section_correctness(bn, a.correctness_cases.split(",")),
        "decode_target": lambda: section_decode_target(bn, DECODE_SWEEP if not a.no_sweep else DECODE_SWEEP[:2]),
        "verify": lambda: section_verify(bn),
        "prefill": lambda: section_prefill(bn, sweep=not a.no_sweep),
        "write_kv": lambda: section_write_kv(bn),
        "decode_grid": lambda: section_decode_grid(bn),
        "verify_more": lambda: section_verify(bn, points=((1, 4096), (128, 4096))),
        "prefill_next": lambda: section_prefill(bn, heads=QWEN3_NEXT, sweep=False, key="prefill_8k_qwen3_next"),
    }
    todo = [n for n in SECTIONS if n in chosen]
    for i, name in enumerate(todo):
        bn.reserve = sum(SECTION_COST[n] for n in todo[i + 1:])
        if bn.time_left() < 20:
            log("out of time before", name)
            break
        try:
            steps[name]()
        except Exception as e:  # noqa: BLE001
            bn.put(name, "error", repr(e)[:1000])
            log("section failed", name, repr(e)[:1000])
    bn.res["elapsed_s"] = time.perf_counter() - T0
    bn.save()
    log("done")


if __name__ == "__main__":
    main()
