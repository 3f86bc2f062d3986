"""What keeps paged decode below the copy rate? Probe kernels that isolate one cause each.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 bench/kernels/paged_decode_probe.py --out bench/results/paged_decode_probe_<dev>.json

Every probe has the shipped decode kernel's grid (request, KV head, KV split) and loop (an online
softmax over KV steps), so only one thing changes at a time:
- `source`: how a KV step's rows are found.
  - "gather": one page id per KV token, then a gather of `[BK, D]` rows (what `kernel.py` does);
  - "pages": one scalar page id per page, then a contiguous `[L, D]` slice load per page;
  - "contig": no page table in the loop (each request's pages are laid out back to back in this
    probe's pool, so one scalar base address per program is enough). This is the no-paging ceiling.
- `math`: "dot" (MMA on rows padded to 16, like the shipped kernel), "fma" (broadcast products
  on exactly H/G rows, no MMA) or "none" (K and V rows are only summed: pure streaming).
plus launch shapes (block_kv, num_warps, num_stages, splits). Each probe's output is checked against
the reference before it is timed, so a figure never comes from a kernel that reads the wrong bytes.
The shipped kernel (`paged_decode`) and a device copy are measured in the same run as anchors.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paged_attention as pab  # noqa: E402  (the shared Bench, copy ceiling and pools)

QWEN3_8B = dict(H=32, G=8, D=128)


def probe_call(q, k_pages, v_pages, page_table, seq_lens, *, source, math_mode, block_kv, splits, num_warps,
               num_stages, sm_scale, order="bgs", interpret=False):
    """`q [B, H, D]` over the paged pool; returns the split partials `(acc, m, l)` like `kernel.py`."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    from pallas_kernels.paged_attention.kernel import next_pow2

    batch, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_heads // num_kv_heads
    rows = next_pow2(max(16, group)) if math_mode == "dot" else next_pow2(group)
    pages_per_split = -(-pages_per_seq // splits)
    step_pages = max(1, block_kv // page_size)
    pages_per_split = -(-pages_per_split // step_pages) * step_pages
    splits = -(-pages_per_seq // pages_per_split)
    scale_log2 = float(sm_scale) * math.log2(math.e)

    def kernel(seq_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref):
        if order == "bgs":
            b, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        else:  # "gbs": the KV heads of one request are neighbours in launch order (they read the same pages)
            g, b, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        seq_len = seq_ref[b]
        lo = s * (pages_per_split * page_size)
        hi = jnp.minimum(lo + pages_per_split * page_size, seq_len)
        n_steps = jnp.maximum(hi - lo, 0) // block_kv  # the probe's contexts are whole steps
        r = jnp.arange(rows, dtype=jnp.int32)
        qv = q_ref[b, g * group + r % group, :]  # [M, D]
        col = jnp.arange(block_kv, dtype=jnp.int32)
        base = pt_ref[b, 0] * page_size  # "contig" only: the request's first slot

        def load(start):
            if source == "gather":
                c = start + col
                slot = pt_ref[b, c // page_size] * page_size + c % page_size
                return [(k_ref[slot, g, :], v_ref[slot, g, :])]
            if source == "pages":
                out = []
                for j in range(step_pages):
                    p = pt_ref[b, start // page_size + j]
                    sl = pl.ds(p * page_size, page_size)
                    out.append((k_ref[sl, g, :], v_ref[sl, g, :]))
                return out
            sl = pl.ds(base + start, block_kv)
            return [(k_ref[sl, g, :], v_ref[sl, g, :])]

        def dot(a, bb, contract_b):
            return lax.dot_general(a, bb, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)

        def body(step, carry):
            acc, m, l = carry
            parts = load(lo + step * block_kv)
            if math_mode == "none":
                for kk, vv in parts:
                    acc = acc + jnp.sum(kk.astype(jnp.float32) + vv.astype(jnp.float32), axis=0)[None, :]
                return acc, m, l
            if math_mode == "dot":
                logits = [dot(qv, kk, 1) * scale_log2 for kk, _ in parts]
            else:
                qf = qv.astype(jnp.float32)
                logits = [jnp.sum(qf[:, None, :] * kk.astype(jnp.float32)[None], axis=2) * scale_log2
                          for kk, _ in parts]
            m_new = m
            for x in logits:
                m_new = jnp.maximum(m_new, jnp.max(x, axis=1))
            alpha = jnp.exp2(m - m_new)
            acc = alpha[:, None] * acc
            l = alpha * l
            for x, (_, vv) in zip(logits, parts):
                p = jnp.exp2(x - m_new[:, None])
                l = l + jnp.sum(p, axis=1)
                if math_mode == "dot":
                    acc = acc + dot(p.astype(vv.dtype), vv, 0)
                else:
                    acc = acc + jnp.sum(p[:, :, None] * vv.astype(jnp.float32)[None], axis=1)
            return acc, m_new, l

        carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                 jnp.zeros((rows,), jnp.float32))
        acc, m, l = lax.fori_loop(0, n_steps, body, carry)
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l

    grid = (batch, num_kv_heads, splits) if order == "bgs" else (num_kv_heads, batch, splits)
    if order == "bgs":
        o_map, s_map = (lambda b, g, s: (b, g, s, 0, 0)), (lambda b, g, s: (b, g, s, 0))
    else:
        o_map, s_map = (lambda g, b, s: (b, g, s, 0, 0)), (lambda g, b, s: (b, g, s, 0))
    o = jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows, head_dim), jnp.float32)
    st = jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32)
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        params["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    return pl.pallas_call(
        kernel, grid=grid, out_shape=[o, st, st], interpret=interpret, name=f"probe_{source}_{math_mode}",
        out_specs=[pl.BlockSpec((None, None, None, rows, head_dim), o_map),
                   pl.BlockSpec((None, None, None, rows), s_map), pl.BlockSpec((None, None, None, rows), s_map)],
        **params,
    )(seq_lens, page_table, q, k_pages.reshape(flat), v_pages.reshape(flat))


def mgpu_stream_call(k_pages, v_pages, page_table, *, splits=4, pages_per_step=4, max_concurrent_steps=4,
                     whole_page=False):
    """Mosaic GPU streaming ceiling: every program TMA-copies its split's K and V pages (one
    `[L, D]` box of KV head g per page, its page id read from the table) through a
    `max_concurrent_steps`-deep SMEM pipeline and computes nothing. Output: a dummy `[B, G, S]`.
    whole_page: one program per (request, split) copies whole `[L, G, D]` pages (contiguous 32 KiB
    at Qwen3-8B shapes) instead of one head's strided rows."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax import lax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    batch, pages_per_seq = page_table.shape
    pages_per_split = pages_per_seq // splits
    steps = pages_per_split // pages_per_step

    def kernel(pt_ref, k_ref, v_ref, o_ref):
        b, g, s = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("s")
        first = s * pages_per_split

        def spec(j):
            if whole_page:
                return pl.BlockSpec((None, page_size, num_kv_heads, head_dim),
                                    lambda i: (pt_ref[b, first + i * pages_per_step + j], 0, 0, 0))
            return pl.BlockSpec((None, page_size, None, head_dim),
                                lambda i: (pt_ref[b, first + i * pages_per_step + j], 0, g, 0))

        def body(idx, *smem):
            del idx, smem

        specs = [spec(j) for j in range(pages_per_step)]
        plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs + specs,
                            max_concurrent_steps=max_concurrent_steps)(*([k_ref] * pages_per_step + [v_ref] * pages_per_step))

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, 1 if whole_page else num_kv_heads, splits), jnp.float32),
        grid=(batch, 1 if whole_page else num_kv_heads, splits), grid_names=("b", "g", "s"),
    )(page_table, k_pages, v_pages)


def finish(acc, m, l, group, dtype):
    """Split partials -> `[B, H, D]` (the probe's rows repeat heads when padded; keep the first H/G)."""
    from pallas_kernels.paged_attention.combine import combine_splits

    rows = combine_splits(acc, m, l, dtype)  # [B, G, M, D]
    b, g, _, d = rows.shape
    return rows[:, :, :group].reshape(b, g * group, d)


def P(source="gather", math="dot", block_kv=64, num_warps=4, num_stages=4, splits=4, order="bgs", table="random"):
    return dict(source=source, math=math, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages,
                splits=splits, order=order, table=table)


# The shipped kernel's choices in probe form, then one change at a time. "table": "random" scatters
# every page over the pool (a pool after allocator churn; what the section decode target times),
# "sorted" keeps each request's pages back to back (required by "contig").
PROBES = [
    P(), P(table="sorted"), P(source="contig", table="sorted"), P(source="pages"),
    P(order="gbs"), P(order="gbs", table="sorted"), P(source="pages", order="gbs"),
    P(math="none"), P(math="none", table="sorted"), P(source="contig", math="none", table="sorted"),
    P(num_stages=2), P(num_stages=3), P(num_stages=5), P(block_kv=32, num_stages=6), P(block_kv=128, num_stages=3),
    P(num_warps=2), P(splits=2), P(splits=8),
    P(order="gbs", splits=2), P(order="gbs", num_stages=3), P(order="gbs", block_kv=128, num_stages=3),
]

# Launch shapes of the shipped form only, timed in more rounds: is splits=2 really faster?
SPLITS_SWEEP = [P(splits=1), P(splits=2), P(), P(splits=2, num_stages=3), P(splits=2, order="gbs"),
                P(splits=2, table="sorted")]


def make_pool(B, ctx, L, G, D, n_sets, table):
    import jax
    import jax.numpy as jnp

    pps = ctx // L
    P_ = n_sets * B * pps + 1
    kk_, kv_ = jax.random.split(jax.random.key(7))
    k = jax.random.normal(kk_, (P_, L, G, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv_, (P_, L, G, D), jnp.float32).astype(jnp.bfloat16)
    rng = np.random.default_rng(0)
    tables = []
    for s_ in range(n_sets):
        if table == "sorted":  # each request's pages back to back, requests of a set shuffled
            order = rng.permutation(B)
            t = 1 + s_ * B * pps + order[:, None] * pps + np.arange(pps)[None, :]
        else:  # every page of the set anywhere
            t = (1 + s_ * B * pps + rng.permutation(B * pps)).reshape(B, pps)
        tables.append(jnp.asarray(t.astype(np.int32)))
    return k, v, tables


def run_probes(bn, *, B=32, ctx=4096, L=16, probes=PROBES, rounds=2, mgpu=True, key="b32_ctx4096_qwen3_8b"):
    """Each probe is timed `rounds` times, interleaved with the other probes (run-to-run spread)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_decode
    from pallas_kernels.paged_attention import reference as ref

    H, G, D = QWEN3_8B["H"], QWEN3_8B["G"], QWEN3_8B["D"]
    kv_bytes = 2 * B * ctx * G * D * 2
    n_sets, R = pab.n_rotations(kv_bytes)
    scale = 1 / math.sqrt(D)
    copy = bn.res.get("copy_tb_per_s")
    qs = [jax.random.normal(jax.random.key(100 + i), (B, H, D), jnp.float32).astype(jnp.bfloat16)
          for i in range(n_sets)]
    seq = jnp.full((B,), ctx, jnp.int32)
    pools, wants = {}, {}
    for table in ("random", "sorted"):
        k, v, tables = make_pool(B, ctx, L, G, D, n_sets, table)
        pools[table] = [(qs[i % n_sets], k, v, tables[i % n_sets], seq) for i in range(R)]
        wants[table] = ref.paged_decode(qs[0], k, v, tables[0], seq, sm_scale=scale).astype(jnp.float32)

    def frac(t):
        return kv_bytes / t / 1e12 / copy if copy else None

    rows = [{"probe": "shipped paged_decode", "table": t, "ms": []} for t in ("random", "sorted")]
    rows += [{"probe": "mgpu_stream", "table": "random", "ms": [], "pages_per_step": pps_, "max_concurrent_steps": mc,
              "whole_page": wp, "splits": sp}
             for pps_, mc, wp, sp in ((4, 4, False, 4), (8, 2, False, 4), (1, 3, True, 4), (1, 2, True, 8),
                                      (1, 3, True, 16), (2, 1, True, 8)) if mgpu]
    rows += [dict(p) | {"ms": []} for p in probes]
    for rnd in range(rounds):
        for row in rows:
            if bn.time_left() < 15 or "error" in row:
                continue
            sets = pools[row["table"]]
            try:
                if row.get("probe") == "mgpu_stream":
                    kw = {k_: row[k_] for k_ in ("pages_per_step", "max_concurrent_steps", "whole_page", "splits")}
                    fn = lambda q, kk, vv, pt, sl, kw=kw: mgpu_stream_call(kk, vv, pt, **kw)  # noqa: E731
                elif "probe" in row:
                    fn = functools.partial(paged_decode, sm_scale=scale)
                else:
                    kw = {k_: row[k_] for k_ in ("source", "block_kv", "splits", "num_warps", "num_stages", "order")}
                    fn = functools.partial(probe_call, math_mode=row["math"], sm_scale=scale, **kw)
                    if rnd == 0 and row["math"] != "none":
                        acc, m, l = jax.jit(fn)(*sets[0])
                        got = finish(acc, m, l, H // G, jnp.float32)
                        want = wants[row["table"]]
                        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                        row["rel_l2"] = err
                        if not err < 2e-2:
                            raise AssertionError(f"probe output wrong: rel_l2 {err}")
                t = bn.time_fn(fn, sets)
                row["ms"].append(round(t * 1e3, 4))
                row["frac_of_copy"] = frac(min(row["ms"]) / 1e3)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
            pab.log("round", rnd, row)
            bn.put("probes", key, rows)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/paged_decode_probe.json")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--splits-sweep", action="store_true", help="only SPLITS_SWEEP, in --rounds rounds")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", choices=["mgpu_stream"], help="only the Mosaic GPU streaming probes (and the anchors)")
    p.add_argument("--cpu-smoke", action="store_true", help="interpret mode on tiny shapes: checks the probes only")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        return cpu_smoke()
    copy = pab.copy_bandwidth()
    bn = pab.Bench(a.out, a.budget_s)
    bn.res["command"] = "PYTHONPATH=. python3 bench/kernels/paged_decode_probe.py " + " ".join(sys.argv[1:])
    bn.res["commit"] = os.environ.get("JSPEC_COMMIT", bn.res["commit"])
    bn.res["copy_reference"] = copy
    bn.res["copy_tb_per_s"] = copy.get("tb_per_s")
    pab.log("device", bn.res["device"], "copy", copy)
    probes = SPLITS_SWEEP if a.splits_sweep else [] if a.only else PROBES
    run_probes(bn, probes=probes, rounds=a.rounds, mgpu=not a.splits_sweep)
    bn.res["elapsed_s"] = time.perf_counter() - pab.T0
    bn.save()


def cpu_smoke():
    """Every probe form in interpret mode against the reference, on a tiny pool."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import reference as ref

    B, L, pps, H, G, D = 2, 16, 8, 8, 2, 32
    n_pages = B * pps + 1
    k = jax.random.normal(jax.random.key(1), (n_pages, L, G, D), jnp.float32)
    v = jax.random.normal(jax.random.key(2), (n_pages, L, G, D), jnp.float32)
    table = jnp.asarray((1 + np.arange(B)[::-1, None] * pps + np.arange(pps)[None]).astype(np.int32))
    seq = jnp.full((B,), pps * L, jnp.int32)
    q = jax.random.normal(jax.random.key(3), (B, H, D), jnp.float32)
    want = ref.paged_decode(q, k, v, table, seq, sm_scale=0.2)
    for source in ("gather", "pages", "contig"):
        for math_mode, bk, order in (("dot", 32, "bgs"), ("dot", 32, "gbs"), ("fma", 16, "bgs")):
            acc, m, l = probe_call(q, k, v, table, seq, source=source, math_mode=math_mode, block_kv=bk, splits=2,
                                   num_warps=4, num_stages=2, sm_scale=0.2, order=order, interpret=True)
            got = finish(acc, m, l, H // G, jnp.float32)
            err = float(jnp.max(jnp.abs(got - want)))
            print(source, math_mode, order, "max abs err", err)
            assert err < 1e-4, (source, math_mode, order, err)
    print("cpu smoke ok")


if __name__ == "__main__":
    main()
