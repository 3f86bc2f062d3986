"""Speculative step cost and throughput for the hidden-state drafters, on real shapes (random bf16).

Targets: a Qwen3-8B shape with an EAGLE3-shaped head (draft vocabulary 32000), and a Qwen3-Next
shape (reduced layer count) with its MTP layer. At each batch size, with `context` tokens of
random KV per request:
- one plain decode step (the reference, same run, same weights, same KV);
- one speculative step, chain (steps 3, topk 1, 4 draft tokens) and tree, timed whole and cut
  after each phase (draft | verify | accept+commit | drafter extend, timed cumulatively; the
  differences are the phases);
- tokens/s at accept lengths 2, 3, 4: a speculative step has a fixed shape whatever is accepted,
  so tokens/s = batch * accept_length / step time, against batch / decode time;
- end to end through `Engine.generate` at batch 1 with `speculative_simulate_accept_length` 3
  (the synchronous spec-v1 loop: host work between steps included) against no speculation.

Usage: python bench/spec_eagle.py --out spec_eagle.json [--targets qwen3-8b:EAGLE3,qwen3-next-12l:NEXTN]
       [--batches 1,8,32,64] [--context 1024] [--e2e 1,32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.engine_decode import commit, log  # noqa: E402
from jspec.bench.step import decode_plan, fill_random_kv, page_table  # noqa: E402
from jspec.cache.pool import PoolLayout  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models.batch import ForwardMode  # noqa: E402
from jspec.models.drafters.loader import random_drafter  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402
from jspec.runtime.model_runner import ModelRunner  # noqa: E402
from jspec.runtime.step import make_step  # noqa: E402
from jspec.runtime.step_inputs import SpecRows  # noqa: E402
from jspec.runtime.step_inputs import Bucket, pack  # noqa: E402
from jspec.speculative import accept, eagle_step, tree_step  # noqa: E402
from jspec.speculative.algorithms import make_drafting  # noqa: E402
from jspec.speculative.config import SpecConfig  # noqa: E402
from jspec.speculative.step_common import begin, compose  # noqa: E402

PHASES = ("draft", "verify", "accept", None)  # None: the whole step


def timed(fn, params, state, packed, iters=20, reps=5):
    """Median seconds per call of fn(params, state, packed) -> (state, out), back to back."""
    for _ in range(3):
        state, out = fn(params, state, packed)
    out.block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            state, out = fn(params, state, packed)
        out.block_until_ready()
        times.append((time.perf_counter() - t) / iters)
    return float(np.median(times)), state


# What a step cut after a phase returns besides the state, so XLA keeps that phase's work.
CUT_OUTPUTS = {
    "draft": lambda c: (c.drafts if "parents" not in c.scratch
                        else jnp.concatenate([c.drafts, c.scratch["parents"]], axis=1)),
    "verify": lambda c: jnp.argmax(c.scratch["logits"], axis=-1),
    "accept": lambda c: accept.output_rows(c.kept, c.n, c.bonus, c.valid),
}


def spec_fn(model, drafter, spec: SpecConfig, bucket, page_size, stop_after):
    """The engine's speculative step of `spec` (stop_after None), or its phases up to `stop_after`
    composed here: the state those phases wrote and the cut phase's result."""
    kw = dict(num_steps=spec.num_steps, simulate_accept_length=spec.simulate_accept_length)
    if spec.topk > 1:
        phases = tree_step.phases(topk=spec.topk, num_draft_tokens=spec.num_draft_tokens, **kw)
    else:
        phases = eagle_step.phases(**kw)
    start = begin(bucket, model.graphdef, drafter.graphdef, page_size=page_size, num_keys=spec.num_steps + 1)
    if stop_after is None:
        return compose(start, phases, SpecRows(width=spec.num_steps + 1, num_top=0))
    upto = [name for name, _ in phases].index(stop_after) + 1

    def step(params, state, packed):
        c = start(params, state, packed)
        for _, phase in phases[:upto]:
            phase(c)
        return dataclasses.replace(state, caches=c.caches, draft_caches=c.draft_caches), CUT_OUTPUTS[stop_after](c)

    return step


def profile(fn, params, state, packed, steps=5):
    """Per-kernel GPU time of `steps` calls (bench/decode_profile.py's aggregation)."""
    import tempfile

    from bench.decode_profile import gpu_kernel_times

    d = tempfile.mkdtemp(prefix="trace-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(steps):
            state, out = fn(params, state, packed)
        out.block_until_ready()
    prof = gpu_kernel_times(d, steps)
    for k in prof.get("top", [])[:15]:
        log(f"    {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['name'][:90]}")
    return prof, state


def bench_target(preset, algo, batches, ctx, trees, split_batches, res, profile_batches=()):
    cfg = parse_hf_config(preset_config(preset))
    log(f"{preset}: random bf16 weights")
    model = random_model(cfg, dtype="bfloat16", seed=0, scale=0.02)
    shape = dict(draft_vocab_size=min(32000, cfg.vocab_size)) if algo == "EAGLE3" else {}
    drafter = random_drafter(algo, model, dtype="bfloat16", seed=1, **shape)
    log(f"{preset}: target {model.num_bytes() / 2**30:.1f} GiB, {algo} drafter "
        f"{sum(x.nbytes for x in jax.tree_util.tree_leaves(drafter.params)) / 2**30:.2f} GiB")
    page_size = 16
    configs = [SpecConfig(algo, 3, 1, 4, None, simulate_accept_length=1.0)]
    configs += [SpecConfig(algo, s, k, n, None, simulate_accept_length=1.0) for s, k, n in trees]
    # Each timed spec step moves every request on by one token (accept length 1) on the device, so
    # the page table covers a margin past the context for the ~100 calls of a measurement.
    ahead = max(c.kv_ahead for c in configs) + 256
    pages_per_seq = -(-(ctx + ahead) // page_size)
    max_b = max(batches)
    layout = PoolLayout(page_size=page_size, num_pages=max_b * pages_per_seq + 1, num_slots=max_b + 1,
                        pages_per_seq=pages_per_seq)
    runner = ModelRunner(model, layout=layout, decode_batch_sizes=[], extend_token_sizes=[], max_extend_requests=1,
                         progress=False, drafting=make_drafting(configs[-1], model, drafter))
    fill_random_kv(runner, jax.random.PRNGKey(5))
    key = jax.random.PRNGKey(6)
    runner.state.draft_caches.kv = [
        tuple(jax.random.normal(jax.random.fold_in(key, 2 * i + j), x.shape, jnp.float32).astype(x.dtype)
              for j, x in enumerate(kv)) for i, kv in enumerate(runner.state.draft_caches.kv)]
    state = runner.state
    params = (model.params, drafter.params)
    out = {"preset": preset, "algorithm": algo, "context": ctx, "points": []}
    for b in batches:
        state.req_to_page = page_table(b, ctx + ahead, page_size, pages_per_seq, max_b + 1)
        plan = decode_plan(b, ctx)
        point = {"batch": b}
        dec_bucket = Bucket(ForwardMode.DECODE, b, b, b, sort=False)
        packed = jax.device_put(pack(plan, dec_bucket))
        t0 = time.perf_counter()
        fn = jax.jit(make_step(model.graphdef, dec_bucket, page_size=page_size, num_top_logprobs=0),
                     donate_argnums=(1,)).lower(model.params, state, packed).compile()
        compile_s = time.perf_counter() - t0
        point["decode_ms"], state = timed(fn, model.params, state, packed)
        point["decode_ms"] *= 1e3
        log(f"B={b}: decode {point['decode_ms']:.3f} ms (compile {compile_s:.0f}s)")
        if b in profile_batches:
            point["decode_profile"], state = profile(fn, model.params, state, packed)
        for sp in configs:
            name = f"s{sp.num_steps}_k{sp.topk}_n{sp.num_draft_tokens}"
            bucket = Bucket(ForwardMode.DECODE, b, b, b * (-(-sp.kv_ahead // page_size) + 1), sort=False)
            packed = jax.device_put(pack(plan, bucket))
            rec = {}
            for phase in (PHASES if b in split_batches else (None,)):
                # Every request's last token at index ctx - 1 again (speculative steps advance it).
                state.seq_lens = jnp.zeros_like(state.seq_lens).at[1:b + 1].set(ctx - 1)
                fn = jax.jit(spec_fn(model, drafter, sp, bucket, page_size, phase), donate_argnums=(1,))
                fn = fn.lower(params, state, packed).compile()
                sec, state = timed(fn, params, state, packed)
                rec[phase or "all"] = sec * 1e3
                if phase is None and b in profile_batches:
                    log(f"B={b} {name} profile:")
                    rec["profile"], state = profile(fn, params, state, packed)
            step_ms = rec["all"]
            entry = {"step_ms": step_ms, "over_decode": step_ms / point["decode_ms"]}
            if "profile" in rec:
                entry["profile"] = rec.pop("profile")
            if "draft" in rec:
                entry["split_ms"] = {"draft": rec["draft"], "verify": rec["verify"] - rec["draft"],
                                     "accept_commit": rec["accept"] - rec["verify"],
                                     "extend": rec["all"] - rec["accept"]}
            entry["tokens_per_s"] = {str(a): b * a / (step_ms / 1e3) for a in (2, 3, 4)}
            entry["speedup"] = {str(a): (a / step_ms) / (1 / point["decode_ms"]) for a in (2, 3, 4)}
            point[name] = entry
            log(f"B={b} {name}: {step_ms:.3f} ms = {entry['over_decode']:.3f}x decode"
                + (f"; split {({k: round(v, 3) for k, v in entry['split_ms'].items()})}" if "split_ms" in entry else "")
                + f"; speedup at a=2,3,4: {[round(v, 2) for v in entry['speedup'].values()]}")
        point["decode_tokens_per_s"] = b / (point["decode_ms"] / 1e3)
        out["points"].append(point)
        res["targets"][f"{preset}:{algo}"] = out
    runner.state = state
    return model, drafter


def e2e(model, drafter, algo, res, *, prompt_len=128, new_tokens=256, batch=1):
    """Engine.generate: no speculation, spec v1 (synchronous loop) and spec v2 (overlap)."""
    from jspec import Engine

    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, min(1000, model.config.vocab_size), prompt_len).tolist() for _ in range(batch)]
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    out = {}
    spec = dict(speculative_algorithm=algo, speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4, speculative_draft_model_path=drafter,
                speculative_simulate_accept_length=3.0)
    for name, kw in (("no_spec", {}), ("spec_sim3_v1", dict(spec, disable_overlap_schedule=True)),
                     ("spec_sim3_v2", spec)):
        eng = Engine(model, cuda_graph_bs=[batch], max_running_requests=batch, context_length=2048,
                     max_total_tokens=batch * 2048 + 64, chunked_prefill_size=256, show_progress=False, **kw)
        try:
            eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=16))  # warm
            t = time.perf_counter()
            outs = eng.generate(input_ids=prompts, sampling_params=sp)
            sec = time.perf_counter() - t
            n = sum(len(o["output_ids"]) for o in outs)
            out[name] = {"tokens_per_s": n / sec, "seconds": sec, "tokens": n}
            if kw:
                out[name]["avg_spec_accept_length"] = eng.get_server_info()["avg_spec_accept_length"]
        finally:
            eng.shutdown()
        log(f"e2e {algo} B={batch} {name}: {out[name]['tokens_per_s']:.1f} tok/s")
    out["speedup_v1"] = out["spec_sim3_v1"]["tokens_per_s"] / out["no_spec"]["tokens_per_s"]
    out["speedup_v2"] = out["spec_sim3_v2"]["tokens_per_s"] / out["no_spec"]["tokens_per_s"]
    out["v2_over_v1"] = out["spec_sim3_v2"]["tokens_per_s"] / out["spec_sim3_v1"]["tokens_per_s"]
    res.setdefault("e2e", {})[f"{algo}_b{batch}"] = out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--targets", default="qwen3-8b:EAGLE3,qwen3-next-12l:NEXTN")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--split-batches", default="1,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--trees", default="5:4:8", help="steps:topk:draft_tokens, comma separated")
    ap.add_argument("--e2e", default="", help="batch sizes for the Engine.generate runs (e.g. 1,32)")
    ap.add_argument("--profile-batches", default="", help="batch sizes whose decode / spec steps get a kernel profile")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    split = {int(b) for b in args.split_batches.split(",") if b}
    trees = [tuple(int(v) for v in t.split(":")) for t in args.trees.split(",") if t]
    res = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "commit": commit(),
           "command": "python " + " ".join(sys.argv), "targets": {}}
    for item in args.targets.split(","):
        preset, algo = item.split(":")
        model, drafter = bench_target(preset, algo, batches, args.context, trees, split, res,
                                      {int(b) for b in args.profile_batches.split(",") if b})
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        for b in ([int(x) for x in args.e2e.split(",")] if args.e2e else []):
            e2e(model, drafter, algo, res, batch=b)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
        del model, drafter


if __name__ == "__main__":
    main()
