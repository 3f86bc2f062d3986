"""GDN kernels on the GPU: correctness against the reference, then timings against peers.

    PYTHONPATH=. python3 bench/kernels/gdn.py [--quick] [--only-prefill | --only-step]

flash-linear-attention is not on the GPU machine: carry the pure-Python `fla-core` wheel (0.6.0 was
used; it needs einops, which is there) and install it first, e.g.
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl fla-core   # here
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl          # there
    export PYTHONPATH=/tmp/site:.:$PYTHONPATH

Checks every Pallas GDN kernel against `pallas_kernels/gdn/reference.py` (float32 math on the
bf16-rounded inputs) on ragged, NaN-poisoned inputs (the chunked prefill also with prefix-cache
snapshot rows inside a request), then times:
- chunked prefill vs flash-linear-attention's Triton `chunk_gated_delta_rule` on identical inputs
  (Qwen3-Next heads: Hk=16, Hv=32, dk=dv=128; 1x8192 and 8x2048 tokens; 3 input sets in rotation
  for both), the two Pallas kernels alone, and a sweep of the state-pass launch parameters;
  `--only-prefill` runs just this (and the ragged check) and keeps the JSON's other sections;
- recurrent decode (32 requests, 1 token) vs a vectorised XLA step and fla's fused_recurrent;
- verify (N = 4 draft tokens) and its ratio to decode;
- conv1d prefill / verify and commit vs their XLA references;
- a device-to-device copy (torch) as the bandwidth ceiling.
Timing: warm-up, then rounds of back-to-back calls ended by one block_until_ready (per-call time =
round time / calls), median over rounds; donated pools; slot sets rotate where the state would
otherwise stay in L2. fla is timed the same way and with triton.testing.do_bench (median).
Results: bench/results/kernels_gdn_<device>.json (and $OUT when set).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (fla) shares the GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import gdn  # noqa: E402
from pallas_kernels.gdn import reference as ref  # noqa: E402
from pallas_kernels.gdn.chunk import DEFAULT_CONFIG, chunk_table, first_chunk_slot  # noqa: E402
from pallas_kernels.gdn.chunk_prepare import chunk_prepare  # noqa: E402
from pallas_kernels.gdn.chunk_state import chunk_state  # noqa: E402
from pallas_kernels.gdn.common import matmul_dtype  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3-Next
CONV_C, CONV_K = 2 * HK * DK + HV * DV, 4
BF16 = jnp.bfloat16
LOG: list[str] = []
ERRORS: list[str] = []


def log(msg):
    print(msg, flush=True)
    LOG.append(str(msg))


def section(name):
    """Run a benchmark section; a failure is recorded and the rest still runs."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            t0 = time.time()
            try:
                return fn(*a, **kw)
            except Exception as e:  # noqa: BLE001
                ERRORS.append(f"{name}: {type(e).__name__}: {str(e)[:1500]}")
                log(f"!! {name} failed: {type(e).__name__}: {str(e)[:600]}")
                LOG.append(traceback.format_exc())
            finally:
                log(f"-- {name}: {time.time() - t0:.1f} s")
        return run
    return wrap


# ------------------------------------------------------------------------------------------ timing


def block(x):
    jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_calls(step, state, *, calls=20, rounds=7, warmup=3):
    """step(state, i) -> state. Median over rounds of (round time / calls), in ms."""
    for i in range(warmup):
        state = step(state, i)
    block(state)
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(calls):
            state = step(state, r * calls + i)
        block(state)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times), state


def time_torch(fn, *, calls=20, rounds=7, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times)


def do_bench(fn):
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rel_err(actual, expected, mask=None):
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    if mask is not None:
        a, e = a[mask], e[mask]
    if np.isnan(a).any():
        return float("nan")
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


# ------------------------------------------------------------------------------------------ inputs


def gdn_inputs(key, num_tokens, num_valid, dtype=BF16):
    """q, k, v (dtype), g (f32 log decay as Qwen3-Next computes it), beta (dtype); padding NaN."""
    kq, kk, kv, ka, kb, kg = jax.random.split(key, 6)
    q = jax.random.normal(kq, (num_tokens, HK, DK), jnp.float32)
    k = jax.random.normal(kk, (num_tokens, HK, DK), jnp.float32)
    v = jax.random.normal(kv, (num_tokens, HV, DV), jnp.float32)
    a_log = jax.random.normal(kg, (HV,), jnp.float32) * 0.5 - 1.0
    g = -jnp.exp(a_log) * jax.nn.softplus(jax.random.normal(ka, (num_tokens, HV), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(kb, (num_tokens, HV), jnp.float32) * 1.5)
    pad = (jnp.arange(num_tokens) >= num_valid)
    poison = lambda x: jnp.where(pad.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.nan, x)  # noqa: E731
    q, k, v, beta = (poison(x).astype(dtype) for x in (q, k, v, beta))
    return q, k, v, poison(g), beta


def f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def cu_of(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


# ------------------------------------------------------------------------------------------ checks


@section("check chunked prefill (ragged, poisoned)")
def check_chunk(res):
    lens = [0, 1, 64, 65, 700, 190]
    num_tokens, slots_n = 1024, 8
    cu = cu_of(lens)
    q, k, v, g, beta = gdn_inputs(jax.random.key(1), num_tokens, int(cu[-1]))
    slots = jnp.asarray([3, 0, 5, 1, 7, 2], jnp.int32)
    has_init = jnp.asarray([True, False, True, True, False, True])
    pool = jnp.full((slots_n, HV, DK, DV), jnp.nan, jnp.float32)
    init_slots = np.asarray(slots)[np.asarray(has_init)]
    pool = pool.at[init_slots].set(0.1 * jax.random.normal(jax.random.key(2), (len(init_slots), HV, DK, DV)))
    o, p = jax.jit(gdn.gated_delta_rule)(q, k, v, g, beta, pool, cu, slots, has_init)
    ro, rp = jax.jit(ref.gated_delta_rule)(*f32(q, k, v), g, beta.astype(jnp.float32), pool, cu, slots, has_init)
    touched = np.asarray(slots)[np.asarray(lens) > 0]
    untouched = np.setdiff1d(np.arange(slots_n), touched)
    res["chunk_ragged"] = dict(
        lens=lens, o_rel_err=rel_err(o, ro), state_rel_err=rel_err(p[touched], rp[touched]),
        padding_zero=bool(jnp.all(o[int(cu[-1]):] == 0)),
        untouched_slots_kept=bool(np.array_equal(np.asarray(p[untouched]), np.asarray(rp[untouched]), equal_nan=True)))
    log(f"chunk ragged: {res['chunk_ragged']}")
    # Prefix-cache snapshots inside a chunk: the state after 64-token chunk ends of the 700-token
    # request (it starts at token 130) also goes to the two free rows.
    saves = jnp.full((num_tokens,), -1, jnp.int32).at[jnp.asarray([130 + 63, 130 + 511])].set(jnp.asarray([4, 6]))
    o, p = jax.jit(gdn.gated_delta_rule)(q, k, v, g, beta, pool, cu, slots, has_init, save_rows=saves)
    ro, rp = jax.jit(ref.gated_delta_rule)(*f32(q, k, v), g, beta.astype(jnp.float32), pool, cu, slots, has_init,
                                           save_rows=saves)
    res["chunk_snapshot_rows"] = dict(
        o_rel_err=rel_err(o, ro), state_rel_err=rel_err(p[touched], rp[touched]),
        snapshot_rel_err=[rel_err(p[r], rp[r]) for r in (4, 6)])
    log(f"chunk snapshot rows: {res['chunk_snapshot_rows']}")


@section("check decode / verify / conv / commit")
def check_small_ops(res):
    batch, n_draft, slots_n = 8, 4, 16
    key = jax.random.key(3)
    slots = jnp.asarray(np.random.default_rng(0).permutation(slots_n)[:batch], jnp.int32)
    pool = 0.1 * jax.random.normal(key, (slots_n, HV, DK, DV), jnp.float32)
    # decode
    q, k, v, g, beta = gdn_inputs(jax.random.key(4), batch, batch)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    has_init = jnp.asarray([True] * (batch - 1) + [False])
    o, p = jax.jit(gdn.gated_delta_rule_decode)(q, k, v, g, beta, pool, cu, slots, has_init)
    ro, rp = jax.jit(ref.gated_delta_rule)(*f32(q, k, v), g, beta.astype(jnp.float32), pool, cu, slots, has_init)
    res["decode"] = dict(o_rel_err=rel_err(o, ro), state_rel_err=rel_err(p[slots], rp[slots]))
    # verify: chains and trees
    parents = jnp.asarray([[-1, 0, 1, 2], [-1, -1, -1, -1], [-1, 0, 0, 1], [-1, 0, -1, 2]] * 2, jnp.int32)
    q, k, v, g, beta = gdn_inputs(jax.random.key(5), batch * n_draft, batch * n_draft)
    o = jax.jit(gdn.gated_delta_rule_verify)(q, k, v, g, beta, pool, slots, parents)
    ro = jax.jit(ref.gated_delta_rule_verify)(*f32(q, k, v), g, beta.astype(jnp.float32), pool, slots, parents)
    res["verify"] = dict(o_rel_err=rel_err(o, ro))
    replay, replay32 = (k, v, g, beta), (*f32(k, v), g, beta.astype(jnp.float32))
    # conv prefill (ragged) and verify
    lens = [0, 1, 2, 3, 700, 190, 5, 60]
    cu = cu_of(lens)
    x = jax.random.normal(jax.random.key(6), (1024, CONV_C), jnp.float32)
    x = jnp.where(jnp.arange(1024)[:, None] < cu[-1], x, jnp.nan).astype(BF16)
    w = (0.5 * jax.random.normal(jax.random.key(7), (CONV_C, CONV_K))).astype(BF16)
    cpool = jax.random.normal(jax.random.key(8), (slots_n, CONV_C, CONV_K - 1)).astype(BF16)
    has_init = jnp.asarray([True, False, True, True, False, True, True, True])
    y, cp = jax.jit(gdn.causal_conv1d)(x, w, cpool, cu, slots, has_init)
    ry, rcp = jax.jit(ref.causal_conv1d)(x, w, cpool, cu, slots, has_init)
    res["conv"] = dict(y_rel_err=rel_err(y, ry), pool_rel_err=rel_err(cp, rcp))
    xv = jax.random.normal(jax.random.key(9), (batch * n_draft, CONV_C)).astype(BF16)
    y, cs = jax.jit(gdn.causal_conv1d_verify)(xv, w, cpool, slots, parents)
    ry, rcs = jax.jit(ref.causal_conv1d_verify)(xv, w, cpool, slots, parents)
    res["conv_verify"] = dict(y_rel_err=rel_err(y, ry), scratch_rel_err=rel_err(cs, rcs))
    # commit: replay the accepted path (chains and trees), copy the conv window
    accepted = jnp.asarray([-1, 0, 3, 1, 2, -1, 0, 3], jnp.int32)
    path = ref.accepted_path(parents, accepted)
    want = jax.jit(ref.commit)(pool, cpool, rcs, *replay32, slots, path, accepted)
    got = jax.jit(gdn.commit)(pool, cpool, rcs, *replay, slots, path, accepted)
    res["commit"] = dict(state_rel_err=rel_err(got[0][slots], want[0][slots]),
                         conv_exact=bool(jnp.array_equal(got[1], want[1])))
    log(f"small ops: { {k_: res[k_] for k_ in ('decode', 'verify', 'conv', 'conv_verify', 'commit')} }")


# ------------------------------------------------------------------------------------------ prefill


def fla_chunk_fn(q, k, v, g, beta, h0, cu):
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    tq, tk, tv, tg, tb = (torch.from_dlpack(x)[None] for x in (q, k, v, g, beta))
    th0 = torch.from_dlpack(h0).contiguous()
    tcu = torch.from_dlpack(cu).to(torch.long)

    def run():
        return chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=tcu)
    return run


def rotating(fns):
    """One callable that cycles through `fns` (one per input set), so no call finds its inputs in L2."""
    it = [0]

    def run():
        it[0] += 1
        return fns[it[0] % len(fns)]()
    return run


# Sweeps, per prefill shape: the state pass's (block_v, warps, stages) for each form of the chunk
# terms (stacked or not), and the whole prefill with the form the default rule does not pick.
STATE_SWEEP = {
    (1, 8192): {True: [(32, 4, 2), (32, 4, 4), (64, 4, 3)], False: [(32, 4, 3), (64, 4, 3)]},
    (8, 2048): {True: [(64, 4, 3)], False: [(32, 4, 3), (64, 4, 2)]},
}
ROTATE = 3  # input sets per timed shape


def prefill_case(shape):
    """Inputs of one timed prefill shape: ROTATE input sets, cu_seqlens, slots, initial pool."""
    batch, seqlen = shape
    num_tokens = batch * seqlen
    sets = [gdn_inputs(jax.random.key(10 + batch + 100 * r), num_tokens, num_tokens) for r in range(ROTATE)]
    cu = cu_of([seqlen] * batch)
    slots = jnp.arange(batch, dtype=jnp.int32)
    has_init = jnp.ones((batch,), bool)
    pool0 = 0.1 * jax.random.normal(jax.random.key(11), (batch, HV, DK, DV), jnp.float32)
    return sets, cu, slots, has_init, pool0


def prepare_fn(stacked, warps=DEFAULT_CONFIG.prepare_warps):
    return jax.jit(functools.partial(chunk_prepare, scale=DK ** -0.5, use_qk_l2norm=True,
                                     mm_dtype=matmul_dtype(BF16), stacked=stacked, num_warps=warps))


def state_fn(bv, warps, stages):
    return jax.jit(functools.partial(chunk_state, block_v=bv, out_dtype=BF16, num_warps=warps,
                                     num_stages=stages), donate_argnums=(3,))


class KernelTimer:
    """Times the two Pallas kernels alone on one prefill shape (terms precomputed per input set)."""

    def __init__(self, shape, stacked):
        self.sets, self.cu, self.slots, self.has_init, self.pool0 = prefill_case(shape)
        num_tokens = shape[0] * shape[1]
        self.start, self.length = jax.jit(chunk_table, static_argnums=1)(self.cu, num_tokens)
        self.first = jax.jit(first_chunk_slot)(self.cu)
        self.prep = prepare_fn(stacked)
        self.terms = [self.prep(*xs, self.start, self.length) for xs in self.sets]

    def prepare(self, **kw):
        ms, _ = time_calls(lambda s, i: self.prep(*self.sets[i % ROTATE], self.start, self.length), None, **kw)
        return ms

    def state(self, fn, **kw):
        def step(pool, i):
            r = i % ROTATE
            q, k = self.sets[r][:2]
            return fn(q, k, self.terms[r], pool, self.cu, self.first, self.slots, self.has_init)[1]
        ms, _ = time_calls(step, self.pool0 + 0, **kw)
        return ms


def time_prefill(cfg, sets, cu, slots, has_init, pool0, save_rows=None, **kw):
    fn = jax.jit(functools.partial(gdn.gated_delta_rule, config=cfg), donate_argnums=(5,))
    extra = {} if save_rows is None else dict(save_rows=save_rows)
    ms, _ = time_calls(lambda pool, i: fn(*sets[i % ROTATE], pool, cu, slots, has_init, **extra)[1], pool0 + 0, **kw)
    return ms


def snapshot_saves(shape, interval=256):
    """save_rows `[T]` of a prefix cache's snapshots inside the chunks (the engine's default
    interval): each request's state after every `interval` tokens goes to a row of its own past the
    request slots. Returns (save_rows, rows)."""
    batch, seqlen = shape
    ends = [r * seqlen + j - 1 for r in range(batch) for j in range(interval, seqlen, interval)]
    saves = np.full((batch * seqlen,), -1, np.int32)
    saves[ends] = batch + np.arange(len(ends))
    return jnp.asarray(saves), len(ends)


@section("chunked prefill vs flash-linear-attention")
def bench_chunk(res, shape):
    batch, seqlen = shape
    num_tokens = batch * seqlen
    name = f"chunk_{batch}x{seqlen}"
    sets, cu, slots, has_init, pool0 = prefill_case(shape)
    q, k, v, g, beta = sets[0]
    cfg = DEFAULT_CONFIG
    stacked = cfg.use_stacked(batch, HV, DV)
    out = dict(tokens=num_tokens, batch=batch, input_sets=ROTATE, stacked=stacked,
               block_v=cfg.state_block_v(batch, HV, DV))

    # correctness at the timed shape: reference (float32 math), ours, fla
    o, p = jax.jit(gdn.gated_delta_rule)(q, k, v, g, beta, pool0, cu, slots, has_init)
    ro, rp = jax.jit(ref.gated_delta_rule)(*f32(q, k, v), g, beta.astype(jnp.float32), pool0, cu, slots, has_init)
    out["ours_o_rel_err"] = rel_err(o, ro)
    out["ours_state_rel_err"] = rel_err(p, rp)
    other = dataclasses.replace(cfg, stacked=not stacked)
    o, p = jax.jit(functools.partial(gdn.gated_delta_rule, config=other))(q, k, v, g, beta, pool0, cu, slots, has_init)
    out["other_form_o_rel_err"] = rel_err(o, ro)
    out["other_form_state_rel_err"] = rel_err(p, rp)
    del o, p
    try:
        fo, fs = fla_chunk_fn(q, k, v, g, beta, pool0, cu)()
        out["fla_o_rel_err"] = rel_err(jnp.asarray(fo[0].float().cpu().numpy()), ro)
        out["fla_state_rel_err"] = rel_err(jnp.asarray(fs.float().cpu().numpy()), rp)
        del fo, fs
        run_fla = rotating([fla_chunk_fn(*xs, pool0, cu) for xs in sets])
        out["fla_ms"] = time_torch(run_fla)
        out["fla_do_bench_ms"] = do_bench(run_fla)
    except Exception as e:  # noqa: BLE001
        ERRORS.append(f"{name} fla: {type(e).__name__}: {str(e)[:800]}")
        log(f"!! fla failed: {e!r}"[:600])
    del ro, rp

    out["ours_ms"] = time_prefill(cfg, sets, cu, slots, has_init, pool0)
    if "fla_ms" in out:
        out["ours_over_fla"] = out["ours_ms"] / out["fla_ms"]
    # the form the rule does not pick, as a whole prefill (its own default block_v)
    out["other_form_ms"] = time_prefill(other, sets, cu, slots, has_init, pool0)
    # with the prefix cache's snapshots inside the chunks (every 256 tokens of each request)
    saves, rows = snapshot_saves(shape)
    wide = jnp.concatenate([pool0, jnp.zeros((rows,) + pool0.shape[1:], pool0.dtype)])
    out["snapshots"] = rows
    out["with_snapshots_ms"] = time_prefill(cfg, sets, cu, slots, has_init, wide, save_rows=saves)
    out["without_snapshots_same_pool_ms"] = time_prefill(cfg, sets, cu, slots, has_init, wide)
    del wide
    log(f"{name}: {out}")

    # where the time goes: the two kernels alone
    timer = KernelTimer(shape, stacked)
    out["prepare_ms"] = timer.prepare()
    out["state_ms"] = timer.state(state_fn(cfg.state_block_v(batch, HV, DV), cfg.state_warps, cfg.state_stages))
    log(f"{name}: prepare {out['prepare_ms']:.4f} ms, state {out['state_ms']:.4f} ms")
    res[name] = out


@section("state-pass launch sweep")
def sweep_chunk(res, shape):
    name = f"chunk_{shape[0]}x{shape[1]}"
    table = {}
    for stacked, configs in STATE_SWEEP.get(shape, {}).items():
        timer = KernelTimer(shape, stacked)
        form = "stacked" if stacked else "per_chunk"
        table[f"{form}_prepare"] = timer.prepare(calls=10, rounds=5)
        for bv, warps, stages in configs:
            key = f"{form}_state_bv{bv}_w{warps}_s{stages}"
            try:
                table[key] = timer.state(state_fn(bv, warps, stages), calls=10, rounds=5)
            except Exception as e:  # noqa: BLE001
                table[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
            log(f"{name} {key}: {table[key]}")
        del timer
    res.setdefault(name, {})["sweep_ms"] = table
    log(f"{name} sweep: {table}")


# ------------------------------------------------------------------------------------------ decode


def xla_decode(q, k, v, g, beta, pool, cu, slots, has_init):
    """Vectorised XLA decode (one token per request): gather states, one step, scatter back."""
    del cu
    qf, kf, vf, gf, bf = ref._prep(q, k, v, g, beta, None, True)
    state = jnp.where(has_init[:, None, None, None], pool[slots], 0.0)
    state, out = ref._step(state, qf, kf, vf, gf, bf)
    return out.astype(q.dtype), pool.at[slots].set(state)


@section("decode / verify / commit")
def bench_decode(res, sweep):
    batch, n_draft, rot = 32, 4, 4
    slots_n = batch * rot
    pool0 = 0.1 * jax.random.normal(jax.random.key(20), (slots_n, HV, DK, DV), jnp.float32)
    slot_sets = [jnp.arange(r * batch, (r + 1) * batch, dtype=jnp.int32) for r in range(rot)]
    q, k, v, g, beta = gdn_inputs(jax.random.key(21), batch, batch)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    has_init = jnp.ones((batch,), bool)
    state_bytes = batch * HV * DK * DV * 4
    out = dict(batch=batch, state_MiB=state_bytes / 2**20)

    def time_decode(fn):
        f = jax.jit(fn, donate_argnums=(5,))
        ms, _ = time_calls(lambda pool, i: f(q, k, v, g, beta, pool, cu, slot_sets[i % rot], has_init)[1], pool0 + 0,
                           calls=50)
        return ms

    out["decode_ms"] = time_decode(gdn.gated_delta_rule_decode)
    out["decode_TBps"] = 2 * state_bytes / out["decode_ms"] / 1e9
    out["xla_decode_ms"] = time_decode(xla_decode)
    if sweep:
        table = {}
        for bv in (16, 32, 64):
            for warps in (2, 4):
                try:
                    table[f"bv{bv}_w{warps}"] = time_decode(
                        functools.partial(gdn.gated_delta_rule_decode, block_v=bv, num_warps=warps))
                except Exception as e:  # noqa: BLE001
                    table[f"bv{bv}_w{warps}"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        out["decode_sweep_ms"] = table

    # verify, N = 4, chain parents (the common case); the pool is read only, no state is written
    qv, kv_, vv, gv, bv_ = gdn_inputs(jax.random.key(22), batch * n_draft, batch * n_draft)
    chain = jnp.tile(jnp.arange(-1, n_draft - 1, dtype=jnp.int32), (batch, 1))
    tree = jnp.tile(jnp.asarray([-1, 0, 0, 1], jnp.int32), (batch, 1))

    def time_verify(fn, parents):
        f = jax.jit(fn)
        ms, _ = time_calls(lambda s, i: f(qv, kv_, vv, gv, bv_, pool0, slot_sets[i % rot], parents), None, calls=30)
        return ms

    out["verify_ms"] = time_verify(gdn.gated_delta_rule_verify, chain)
    out["verify_tree_ms"] = time_verify(gdn.gated_delta_rule_verify, tree)
    out["xla_verify_ms"] = time_verify(ref.gated_delta_rule_verify, chain)
    out["verify_over_decode"] = out["verify_ms"] / out["decode_ms"]
    out["verify_TBps"] = state_bytes / out["verify_ms"] / 1e9
    if sweep:
        table = {}
        for bvs in (16, 32, 64):
            for warps in (4,):
                try:
                    table[f"bv{bvs}_w{warps}"] = time_verify(
                        functools.partial(gdn.gated_delta_rule_verify, block_v=bvs, num_warps=warps), chain)
                except Exception as e:  # noqa: BLE001
                    table[f"bv{bvs}_w{warps}"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        out["verify_sweep_ms"] = table

    # commit: every request accepts a node (the most bytes); replays its path over the state
    cpool0 = jax.random.normal(jax.random.key(24), (slots_n, CONV_C, CONV_K - 1)).astype(BF16)
    cscratch = jax.random.normal(jax.random.key(25), (batch, n_draft, CONV_C, CONV_K - 1)).astype(BF16)
    accepted = jnp.asarray(np.random.default_rng(1).integers(0, n_draft, batch), jnp.int32)
    path = ref.accepted_path(chain, accepted)

    def time_commit(fn):
        f = jax.jit(fn, donate_argnums=(0, 1))
        ms, _ = time_calls(lambda pools, i: f(*pools, cscratch, kv_, vv, gv, bv_, slot_sets[i % rot], path,
                                              accepted), (pool0 + 0, cpool0 + 0), calls=30)
        return ms

    out["commit_ms"] = time_commit(gdn.commit)
    out["xla_commit_ms"] = time_commit(ref.commit)
    # The same commit also storing a path node's state in a prefix-cache snapshot row for every
    # request (the hybrid cache's decode-time tracks; rows of another slot set, so none is committed).
    track_node = jnp.where(accepted > 0, accepted - 1, 0)
    f = jax.jit(gdn.commit, donate_argnums=(0, 1))
    out["commit_tracked_ms"], _ = time_calls(
        lambda pools, i: f(*pools, cscratch, kv_, vv, gv, bv_, slot_sets[i % rot], path, accepted, track_node,
                           slot_sets[(i + 1) % rot]), (pool0 + 0, cpool0 + 0), calls=30)
    if os.path.exists(os.path.join(os.path.dirname(__file__), "gdn_commit_before.py")):
        # A probe: the commit kernel as it was before tracking (a copy placed beside this file).
        sys.path.insert(0, os.path.dirname(__file__))
        from gdn_commit_before import commit as commit_before
        out["commit_before_tracking_ms"] = time_commit(commit_before)
    out["commit_TBps"] = 2 * (state_bytes + batch * CONV_C * (CONV_K - 1) * 2) / out["commit_ms"] / 1e9
    # What a speculative step pays per GDN layer for the recurrent state, against one decode step.
    out["verify_plus_commit_over_decode"] = (out["verify_ms"] + out["commit_ms"]) / out["decode_ms"]

    # fla fused_recurrent as the peer for decode (1 token) and a 4-token recurrence (final state only)
    try:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        h0 = torch.from_dlpack(pool0[:batch]).contiguous()
        for t_per in (1, 4):
            qq, kk, vv2, gg, bb = gdn_inputs(jax.random.key(26 + t_per), batch * t_per, batch * t_per)
            tq, tk, tv, tg, tb = (torch.from_dlpack(x).reshape((batch, t_per) + x.shape[1:])
                                  for x in (qq, kk, vv2, gg, bb))

            def run(tq=tq, tk=tk, tv=tv, tg=tg, tb=tb):
                return fused_recurrent_gated_delta_rule(tq, tk, tv, tg, beta=tb, initial_state=h0,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
            out[f"fla_recurrent_{t_per}tok_ms"] = time_torch(run, calls=50)
            out[f"fla_recurrent_{t_per}tok_do_bench_ms"] = do_bench(run)
    except Exception as e:  # noqa: BLE001
        ERRORS.append(f"fla recurrent: {type(e).__name__}: {str(e)[:800]}")
        log(f"!! fla recurrent failed: {e!r}"[:600])
    res["decode_b32"] = out
    log(f"decode: {out}")


# ------------------------------------------------------------------------------------------ conv


@section("conv1d")
def bench_conv(res, sweep):
    out = {}
    for batch, seqlen in ((1, 8192), (8, 2048)):
        num_tokens = batch * seqlen
        x = jax.random.normal(jax.random.key(30), (num_tokens, CONV_C)).astype(BF16)
        w = (0.5 * jax.random.normal(jax.random.key(31), (CONV_C, CONV_K))).astype(BF16)
        cpool0 = jax.random.normal(jax.random.key(32), (batch, CONV_C, CONV_K - 1)).astype(BF16)
        cu = cu_of([seqlen] * batch)
        slots = jnp.arange(batch, dtype=jnp.int32)
        has_init = jnp.ones((batch,), bool)
        for label, fn in (("ours", gdn.causal_conv1d), ("xla", ref.causal_conv1d)):
            f = jax.jit(fn, donate_argnums=(2,))
            ms, _ = time_calls(lambda p, i: f(x, w, p, cu, slots, has_init)[1], cpool0 + 0)
            out[f"conv_{batch}x{seqlen}_{label}_ms"] = ms
        ours_ms = out[f"conv_{batch}x{seqlen}_ours_ms"]
        out[f"conv_{batch}x{seqlen}_ours_TBps"] = 2 * num_tokens * CONV_C * 2 / ours_ms / 1e9
        if sweep and batch == 1:
            for bt, bc in ((16, 128), (64, 128), (16, 256), (32, 256)):
                f = jax.jit(functools.partial(gdn.causal_conv1d, block_t=bt, block_c=bc), donate_argnums=(2,))
                out[f"conv_1x8192_sweep_t{bt}_c{bc}_ms"], _ = time_calls(
                    lambda p, i: f(x, w, p, cu, slots, has_init)[1], cpool0 + 0, calls=10, rounds=5)
    batch, n_draft = 32, 4
    xv = jax.random.normal(jax.random.key(33), (batch * n_draft, CONV_C)).astype(BF16)
    w = (0.5 * jax.random.normal(jax.random.key(31), (CONV_C, CONV_K))).astype(BF16)
    cpool = jax.random.normal(jax.random.key(34), (batch * 4, CONV_C, CONV_K - 1)).astype(BF16)
    chain = jnp.tile(jnp.arange(-1, n_draft - 1, dtype=jnp.int32), (batch, 1))
    slot_sets = [jnp.arange(r * batch, (r + 1) * batch, dtype=jnp.int32) for r in range(4)]
    for label, fn in (("ours", gdn.causal_conv1d_verify), ("xla", ref.causal_conv1d_verify)):
        f = jax.jit(fn)
        out[f"conv_verify_b32_n4_{label}_ms"], _ = time_calls(lambda s, i: f(xv, w, cpool, slot_sets[i % 4], chain),
                                                              None, calls=50)
    res["conv"] = out
    log(f"conv: {out}")


@section("copy bandwidth")
def bench_copy(res):
    import torch

    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    res["copy_TBps"] = 2 * src.numel() * 4 / ms / 1e9
    log(f"copy: {res['copy_TBps']:.2f} TB/s")
    del src, dst


def git_commit():
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "pallas_kernels/gdn", "bench/kernels"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+uncommitted" if dirty else "")
    except Exception:  # noqa: BLE001
        return "uncommitted"


PREFILL_KEYS = ("chunk_ragged", "chunk_snapshot_rows", "chunk_1x8192", "chunk_8x2048")


STEP_KEYS = ("copy_TBps", "decode", "verify", "conv_verify", "commit", "decode_b32")


def save(res, argv, dev_name, only=None):
    """Write the JSON record (after every section, so a run cut short still reports).

    With --only-prefill / --only-step the record already in bench/results keeps its other sections:
    only that part's results are replaced, and `prefill_run` / `step_run` says where and how they
    were measured.
    """
    command = "PYTHONPATH=. python3 bench/kernels/gdn.py " + " ".join(argv if argv is not None else sys.argv[1:])
    run = dict(device=dev_name, jax_version=jax.__version__, commit=os.environ.get("JSPEC_COMMIT") or git_commit(),
               command=command, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               default_chunk_config=dataclasses.asdict(DEFAULT_CONFIG))
    slug = dev_name.lower().replace("nvidia", "").strip().replace(" ", "_")
    path = os.path.join("bench/results", f"kernels_gdn_{slug}.json")
    if only:
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = dict(results={}, errors=[])
        record[f"{only}_run"] = run
        keys = PREFILL_KEYS if only == "prefill" else STEP_KEYS
        record["results"].update({k: v for k, v in res.items() if k in keys})
        record[f"{only}_errors"] = ERRORS
    else:
        record = dict(run, results=res, errors=ERRORS)
        record["prefill_run"] = record["step_run"] = run
    text = json.dumps(record, indent=1, default=float)
    for folder in ("bench/results", os.environ.get("OUT")):
        if folder:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"kernels_gdn_{slug}.json"), "w") as f:
                f.write(text + "\n")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gdn_log.txt"), "w") as f:
            f.write("\n".join(LOG))
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the launch-parameter sweeps")
    parser.add_argument("--only-prefill", action="store_true",
                        help="chunked prefill only (check, 1x8192, 8x2048 vs fla); other results kept")
    parser.add_argument("--only-step", action="store_true",
                        help="copy, small-op checks, decode / verify / commit only; other results kept")
    args = parser.parse_args(argv)
    only = "prefill" if args.only_prefill else "step" if args.only_step else None
    dev_name = jax.devices()[0].device_kind
    log(f"device {dev_name}, jax {jax.__version__}, backend {jax.default_backend()}")
    res: dict = {}
    shapes = ((1, 8192), (8, 2048))
    # Both shapes' headline numbers before any sweep, so a run cut short still has them.
    prefill = ([lambda: check_chunk(res)] + [functools.partial(bench_chunk, res, s) for s in shapes]
               + ([] if args.quick else [functools.partial(sweep_chunk, res, s) for s in shapes]))
    step_part = [
        lambda: bench_copy(res),
        lambda: check_small_ops(res),
        lambda: bench_decode(res, sweep=not args.quick),
    ]
    steps = {"prefill": prefill, "step": step_part}.get(only, step_part + [
        lambda: bench_conv(res, sweep=not args.quick)] + prefill)
    for step in steps:
        step()
        text = save(res, argv, dev_name, only)
    for name in PREFILL_KEYS[2:]:
        r = res.get(name, {})
        log(f"{name}: ours {r.get('ours_ms', float('nan')):.4f} ms, fla {r.get('fla_ms', float('nan')):.4f} ms "
            f"(do_bench {r.get('fla_do_bench_ms', float('nan')):.4f}), ours/fla {r.get('ours_over_fla', float('nan')):.4f}, "
            f"prepare {r.get('prepare_ms', float('nan')):.4f}, state {r.get('state_ms', float('nan')):.4f}, "
            f"other form {r.get('other_form_ms', float('nan')):.4f}, "
            f"err o {r.get('ours_o_rel_err', float('nan')):.2e} state {r.get('ours_state_rel_err', float('nan')):.2e}")
    if only != "prefill":
        log(text[:8000])


if __name__ == "__main__":
    main()
