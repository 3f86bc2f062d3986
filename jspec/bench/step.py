"""`jspec bench step`: a per-step roofline report for a model shape.

For each (batch, context) the engine's compiled decode step runs on `batch` requests that each hold
`context` tokens of random KV (never zeros); its median time is set against the bytes it must move
(weights it touches + KV it reads + GDN state it reads and writes) over the device-to-device copy
bandwidth measured in the same run. `--profile DIR` also writes a jax.profiler trace of a few steps.

The record keeps a `speculative_split_ms` field (null here) so its rows stay comparable with
speculative ones; the phases of a speculative step are timed by bench/spec_eagle.py.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache.memory import device_memory
from jspec.cache.pool import PoolLayout
from jspec.errors import ConfigError
from jspec.models.batch import ForwardMode
from jspec.runtime.model_runner import ModelRunner
from jspec.runtime.request import Request
from jspec.runtime.sampling_params import SamplingParams
from jspec.runtime.scheduler import ScheduledReq, StepPlan
from jspec.runtime.step_inputs import pack
from jspec.sharding import is_mixer, path_name


def copy_bandwidth(num_bytes: int = 1 << 30) -> dict:
    """Bytes read + written per second by a large device-to-device copy: the memory ceiling.

    On GPUs torch's `copy_` is used when torch is installed (a plain copy kernel); JAX has no
    standalone copy op, and an elementwise op reaches noticeably less (DESIGN.md §6)."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device for torch")
        src = torch.randn(num_bytes // 4, device="cuda", dtype=torch.float32)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        sec = float(np.median(times))
        del src, dst
        torch.cuda.empty_cache()
        return {"bytes": 2 * num_bytes, "seconds": sec, "bytes_per_s": 2 * num_bytes / sec,
                "how": f"torch copy_ of {num_bytes >> 20} MiB"}
    except Exception as e:  # noqa: BLE001 - CPU runs and machines without torch
        x = jax.random.normal(jax.random.PRNGKey(0), (num_bytes // 4,), jnp.float32)
        f = jax.jit(lambda v: v * 1.0000001)
        f(x).block_until_ready()
        t = time.perf_counter()
        for _ in range(10):
            y = f(x)
        y.block_until_ready()
        sec = (time.perf_counter() - t) / 10
        return {"bytes": 2 * x.nbytes, "seconds": sec, "bytes_per_s": 2 * x.nbytes / sec,
                "how": f"jax elementwise pass (no torch copy: {type(e).__name__})"}


def fill_random_kv(runner: ModelRunner, key) -> None:
    """Random KV pages and GDN states: timing on zeros can flatter a kernel."""
    caches = runner.state.caches
    kv = []
    for i, (k, v) in enumerate(caches.kv):
        kk = jax.random.normal(jax.random.fold_in(key, 2 * i), k.shape, jnp.float32).astype(k.dtype)
        vv = jax.random.normal(jax.random.fold_in(key, 2 * i + 1), v.shape, jnp.float32).astype(v.dtype)
        kv.append((jax.device_put(kk, k.sharding), jax.device_put(vv, v.sharding)))
    ssm = [jax.device_put(jax.random.normal(jax.random.fold_in(key, 1000 + i), s.shape, jnp.float32) * 0.1, s.sharding)
           for i, s in enumerate(caches.ssm)]
    runner.state.caches.kv, runner.state.caches.ssm = kv, ssm


def decode_plan(batch: int, context: int) -> StepPlan:
    """`batch` running requests (slots 1..batch), each with `context - 1` cached tokens, decoding one."""
    sp = SamplingParams(max_new_tokens=1 << 20, temperature=0.0)
    reqs = []
    for i in range(batch):
        r = Request(rid=str(i), input_ids=[1] * (context - 1), sampling=sp, seed=i)
        r.slot = i + 1
        reqs.append(ScheduledReq(r, context - 1, None, True, False, 0))
    return StepPlan(ForwardMode.DECODE, reqs, [])


def page_table(batch: int, context: int, page_size: int, pages_per_seq: int, num_slots: int):
    """Each request's pages contiguous in its own range; unused slots point at the sink page 0."""
    t = np.zeros((num_slots, pages_per_seq), np.int32)
    per = -(-context // page_size)
    for i in range(batch):
        t[i + 1, :per] = 1 + i * per + np.arange(per)
    return jnp.asarray(t)


def time_step(runner: ModelRunner, bucket, packed, iters: int = 20, reps: int = 5) -> float:
    """Median seconds per step over `reps` runs of `iters` back-to-back steps (after warm-up)."""
    fn = runner.compiled[bucket]
    for _ in range(3):
        runner.state, out = fn(runner.params, runner.state, packed)
    out.block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            runner.state, out = fn(runner.params, runner.state, packed)
        out.block_until_ready()
        times.append((time.perf_counter() - t) / iters)
    return float(np.median(times))


def bytes_per_step(cfg, model, batch: int, context: int) -> dict:
    """Fewest bytes one decode step must move: weights it touches (MoE: expected distinct experts
    for batch * top-k uniform draws), KV it reads, GDN state it reads and writes."""
    itemsize = np.dtype(model.dtype).itemsize
    total = model.num_bytes()
    if cfg.num_experts:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize
        n_moe = sum(cfg.moe_layers)
        touched = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)
        weights = total - n_moe * cfg.num_experts * per_expert + n_moe * touched * per_expert
    else:
        weights = total
    kv = batch * context * len(cfg.attention_layer_ids) * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    gdn = 0
    if cfg.is_hybrid:
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        conv = cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * itemsize
        gdn = 2 * batch * len(cfg.gdn_layer_ids) * (state + conv)
    # One device's share when split: mixers (and their KV / state) by mixer_tp_size, the rest by tp.
    mixer = _mixer_bytes(model)
    per_device = ((weights - mixer) / model.tp_size + (mixer + kv + gdn) / model.mixer_tp_size)
    return {"weights": float(weights), "kv": float(kv), "gdn_state": float(gdn), "total": float(weights + kv + gdn),
            "per_device": float(per_device)}


def _mixer_bytes(model) -> int:
    """Bytes of the target's attention and Gated DeltaNet parameters."""
    flat = jax.tree_util.tree_leaves_with_path(model.params)
    return sum(int(x.size * x.dtype.itemsize) for path, x in flat if is_mixer(path_name(path)))


def check_fits(model, kv_tokens: int, points) -> None:
    """Refuse a grid whose KV pool cannot sit beside the weights, before allocating anything
    (an allocation that fails on the GPU can stall in the allocator's retries instead of failing)."""
    cfg = model.config
    attn_layers = len(cfg.attention_layer_ids)
    kv_bytes = kv_tokens * attn_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
    weight_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                       for x in jax.tree_util.tree_leaves(model.params))  # per device when split
    kv_bytes /= model.mixer_tp_size
    held = device_memory()
    limit = held.bytes_limit if held else None
    if limit and weight_bytes + kv_bytes > 0.9 * limit:
        worst = max(points, key=lambda p: p[0] * p[1])
        raise ConfigError(
            f"bench step: the KV pool for batch x context up to {worst[0]} x {worst[1]} needs "
            f"{kv_bytes / 2**30:.1f} GiB beside {weight_bytes / 2**30:.1f} GiB of weights, more than 90% of the "
            f"device's {limit / 2**30:.1f} GiB; use smaller --batch-sizes / --context-lens")


def roofline(model, points: list[tuple[int, int]], *, copy_bps: float, page_size: int = 16,
             profile_dir: str | None = None, iters: int = 20, reps: int = 5) -> list[dict]:
    """One record per (batch, context): ms/step, bytes, floor, fraction of the copy rate."""
    cfg = model.config
    max_b = max(b for b, _ in points)
    pages_per_seq = -(-max(c for _, c in points) // page_size)
    need_pages = max(b * -(-c // page_size) for b, c in points) + 1
    check_fits(model, need_pages * page_size, points)
    layout = PoolLayout(page_size=page_size, num_pages=need_pages, num_slots=max_b + 1, pages_per_seq=pages_per_seq)
    runner = ModelRunner(model, layout=layout, decode_batch_sizes=sorted({b for b, _ in points}),
                         extend_token_sizes=[], max_extend_requests=1, progress=False)
    fill_random_kv(runner, jax.random.PRNGKey(7))
    out = []
    for b, c in points:
        # The step a greedy or plain-temperature batch runs (not the top-k / top-p sort variant).
        bucket = next(x for x in runner.buckets if x.batch_size == b and not x.sort)
        runner.state.req_to_page = jax.device_put(page_table(b, c, page_size, pages_per_seq, max_b + 1),
                                                  runner.state.req_to_page.sharding)
        packed = jax.device_put(pack(decode_plan(b, c), bucket), runner.state.req_to_page.sharding)
        sec = time_step(runner, bucket, packed, iters=iters, reps=reps)
        by = bytes_per_step(cfg, model, b, c)
        floor = by["per_device"] / copy_bps  # each device reads its share, in parallel
        rec = {"batch": b, "context": c, "ms_per_step": sec * 1e3, "bytes": by,
               "achieved_bytes_per_s": by["total"] / sec, "floor_ms": floor * 1e3,
               "fraction_of_copy_bandwidth": floor / sec, "tokens_per_s": b / sec,
               "compile_s": runner.compile_seconds, "tp_size": model.tp_size,
               "replicate_attention": model.replicate_attention,
               "speculative_split_ms": None}  # a plain decode step has no phases
        if profile_dir:
            with jax.profiler.trace(f"{profile_dir}/b{b}_ctx{c}", create_perfetto_trace=True):
                for _ in range(5):
                    runner.state, o = runner.compiled[bucket](runner.params, runner.state, packed)
                o.block_until_ready()
            rec["profile_dir"] = f"{profile_dir}/b{b}_ctx{c}"
        out.append(rec)
    return out


def step_table(records: list[dict], copy: dict) -> str:
    lines = [f"copy bandwidth {copy['bytes_per_s'] / 1e12:.3f} TB/s ({copy['how']})",
             f"{'batch':>6} {'context':>8} {'ms/step':>9} {'floor ms':>9} {'of copy':>8} {'GB moved':>9} {'tok/s':>10}",]
    for r in records:
        lines.append(f"{r['batch']:>6} {r['context']:>8} {r['ms_per_step']:>9.3f} {r['floor_ms']:>9.3f} "
                     f"{r['fraction_of_copy_bandwidth']:>8.2f} {r['bytes']['total'] / 1e9:>9.3f} {r['tokens_per_s']:>10.1f}")
    return "\n".join(lines)
