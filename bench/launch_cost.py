"""What launching one compiled decode step costs the host, apart from what the step costs the device.

A jitted step returns as soon as its work is queued; with overlap the host queues step N + 1 while
step N runs, so the launch hides behind the device. A step that must wait for the host in the
middle (the grammar-constrained speculative step, `jspec/runtime/split_step.py`) cannot hide it.
This probe times, for the engine's plain decode step on a model shape (random weights, random KV):

- idle_same: the device idle, the same packed input array as the step before: host seconds of the
  call (the launch), then seconds until the result is ready;
- idle_fresh: the device idle, a packed input just transferred (a new device buffer, as every engine
  step has): the same two times;
- pipelined: back-to-back calls with fresh inputs, as the engine's loop runs them: host seconds per
  call (a launch that blocks behind the step in flight shows here) and seconds per step.

Run it under different XLA_FLAGS (command buffers on / off) to see what capture costs the host.

`--twins` loads a second copy of each step (serialized and loaded again: its own command buffers)
and alternates the two call by call. XLA re-records a captured graph whenever a buffer it uses
moved since that graph's last run; with one step in flight the outputs and temporaries alternate
between two addresses, so one copy per parity may see the same addresses every time. Count the
re-recordings with `TF_CPP_VMODULE=command_buffer_thunk=3` (lines "Updated command buffer in").

    PYTHONPATH=. python3 bench/launch_cost.py --preset qwen3-8b --batch-sizes 1,32 --out OUT.json

`--variants plain,twins,stage,stage+twins,...` probes each bucket several ways in one process. `stage`
copies each fresh packed input into one persistent device buffer first (a one-copy jitted program
that donates that buffer and returns it, so its address never changes) and hands the step that
buffer: what is left moving is then the step's fresh outputs and temporaries. A line
`=== variant NAME batch B` goes to stderr before each, so an XLA log can be split by variant.

`arena` (combinable: `stage+twins+arena`) compiles the step again so that it writes its output rows
into a donated buffer (stable address) and hands the host a copy made by a one-copy program.

`--processes N` runs the probe multi-controller (one process per device, `bench/multiprocess.py`):
each process launches only its own device's part of the step, as SGLang's one process per
tensor-parallel rank does; rank 0 reports.

`--profile DIR` traces each bucket's back-to-back loop (`bench/trace_summary.py DIR/<bucket>`).
`--prompt-tokens 256,2048` probes prompt steps instead: a bucket of that many tokens carrying
`--prompt-requests` requests (each a chunk that samples), compiled in its three sampler variants:
sort None (top-k / top-p decided on the device by a conditional, what an engine that allows them
compiles), True (always sorted) and False (never; an engine with disable_top_k_top_p). A
conditional whose predicate XLA reads on the host shows as a launch that lasts the whole step.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from jax.experimental import serialize_executable  # noqa: E402
import numpy as np  # noqa: E402

from bench import multiprocess  # noqa: E402
from jspec.bench.record import append_jsonl, environment  # noqa: E402
from jspec.bench.step import decode_plan, fill_random_kv, page_table  # noqa: E402
from jspec.cache.pool import PoolLayout  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models import dispatch  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402
from jspec.runtime.model_runner import ModelRunner  # noqa: E402
from jspec.runtime.scheduler import ScheduledReq, StepPlan  # noqa: E402
from jspec.runtime.request import Request  # noqa: E402
from jspec.runtime.sampling_params import SamplingParams  # noqa: E402
from jspec.runtime.step_inputs import ForwardMode  # noqa: E402
from jspec.runtime.step_inputs import pack  # noqa: E402


def twin(fn, devices):
    """A second loaded copy of a compiled step (its own command-buffer state)."""
    return serialize_executable.deserialize_and_load(*serialize_executable.serialize(fn),
                                                     execution_devices=list(devices))


def arena_step(runner: ModelRunner, bucket):
    """The bucket's step compiled again so that its output rows land in a donated buffer it is
    handed (the same address every call), plus a one-copy program that hands the host a fresh
    array of them: (step(params, state, packed, out_buf) -> (state, out_buf), copy_out)."""
    step, sharding = runner.step_fn(bucket), runner.state.req_to_page.sharding

    def fn(params, state, packed, out_buf):
        state, out = step(params, state, packed)
        return state, jax.lax.dynamic_update_slice(out_buf, out, (0,) * out.ndim)

    with dispatch.tensor_parallel(runner.mesh):
        shapes = jax.eval_shape(step, runner.params, runner.state, jax.ShapeDtypeStruct((bucket.size,), np.int32))
        compiled = jax.jit(fn, donate_argnums=(1, 3), out_shardings=(runner.state_shardings(runner.state), sharding)
                           ).lower(runner.params, runner.state, jax.ShapeDtypeStruct((bucket.size,), np.int32,
                                                                                     sharding=sharding),
                                   jax.ShapeDtypeStruct(shapes[1].shape, shapes[1].dtype, sharding=sharding)).compile()
    out_buf = jax.device_put(np.zeros(shapes[1].shape, shapes[1].dtype), sharding)
    return compiled, out_buf, jax.jit(lambda b: b + 0, out_shardings=sharding)


def probe(runner: ModelRunner, bucket, host_packed: np.ndarray, reps: int, profile: str | None = None,
          twins: bool = False, stage: bool = False, arena: bool = False) -> dict:
    compiled, sharding = runner.compiled[bucket], runner.state.req_to_page.sharding
    if arena:
        compiled, out_buf, copy_out = arena_step(runner, bucket)
        held = [out_buf]
    copies = [compiled, twin(compiled, runner.mesh.devices.flat)] if twins else [compiled]
    turn = itertools.count()
    staged = [jax.device_put(host_packed, sharding)] if stage else None
    # The output aliases the donated buffer, so XLA writes the new input into the same address
    # (written as an update of `buf`: a function that returns `new` itself is forwarded by jit
    # without running, and the buffer would move).
    copy_in = jax.jit(lambda buf, new: jax.lax.dynamic_update_slice(buf, new, (0,) * new.ndim),
                      donate_argnums=(0,), out_shardings=sharding)

    def fn(params, state, packed):  # the copies in turn, call by call
        if stage:
            staged[0] = copy_in(staged[0], packed)
            packed = staged[0]
        exe = copies[next(turn) % len(copies)]
        if not arena:
            return exe(params, state, packed)
        state, held[0] = exe(params, state, packed, held[0])
        return state, copy_out(held[0])

    same = jax.device_put(host_packed, sharding)
    for _ in range(4):
        runner.state, out = fn(runner.params, runner.state, same)
    out.block_until_ready()
    rows = {}
    for name in ("idle_same", "idle_fresh"):
        launch, total = [], []
        for _ in range(reps):
            packed = same if name == "idle_same" else jax.device_put(host_packed, sharding)
            packed.block_until_ready()
            t0 = time.perf_counter()
            runner.state, out = fn(runner.params, runner.state, packed)
            t1 = time.perf_counter()
            out.block_until_ready()
            t2 = time.perf_counter()
            launch.append(t1 - t0)
            total.append(t2 - t0)
        rows[name] = {"launch_ms": 1e3 * float(np.median(launch)), "launch_p90_ms": 1e3 * float(np.percentile(launch, 90)),
                      "until_ready_ms": 1e3 * float(np.median(total))}
    calls = []
    # profile: a perfetto trace of this back-to-back loop in profile/<bucket> (bench/trace_summary.py),
    # to see where a call that blocks the host waits.
    tracing = jax.profiler.trace(os.path.join(profile, f"{bucket.label}_sort{bucket.sort}".replace(" ", "_"))) if profile else None
    if tracing is not None:
        tracing.__enter__()
    t_all = time.perf_counter()
    for _ in range(reps):
        packed = jax.device_put(host_packed, sharding)
        t0 = time.perf_counter()
        runner.state, out = fn(runner.params, runner.state, packed)
        calls.append(time.perf_counter() - t0)
    out.block_until_ready()
    if tracing is not None:
        tracing.__exit__(None, None, None)
    rows["pipelined"] = {"call_ms": 1e3 * float(np.median(calls)),
                         "step_ms": 1e3 * (time.perf_counter() - t_all) / reps}
    return rows


def prompt_plan(tokens: int, requests: int) -> StepPlan:
    """`requests` prompt chunks that fill `tokens`, slots 1..requests, each sampling its first token
    (temperature 1 with top-p 0.9: the rows the sort serves)."""
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9)
    per = tokens // requests
    reqs = []
    for i in range(requests):
        r = Request(rid=str(i), input_ids=[1 + i] * per, sampling=sp, seed=i)
        r.slot = i + 1
        reqs.append(ScheduledReq(r, 0, [1 + i] * per, True, True, 0))
    return StepPlan(ForwardMode.EXTEND, reqs, [])


def prompt_main(args, model) -> list[dict]:
    tokens = [int(t) for t in args.prompt_tokens.split(",")]
    page = 16
    per = -(-max(tokens) // page)
    layout = PoolLayout(page_size=page, num_pages=args.prompt_requests * per + 1, num_slots=args.prompt_requests + 1,
                        pages_per_seq=per)
    runner = ModelRunner(model, layout=layout, decode_batch_sizes=[1], extend_token_sizes=tokens,
                         max_extend_requests=args.prompt_requests, progress=False, compile=False)
    base = [b for b in runner.buckets if b.mode is ForwardMode.EXTEND]
    sorts = [{"None": None, "True": True, "False": False}[x] for x in args.sorts.split(",")]
    runner.buckets = [dataclasses.replace(b, sort=s) for b in base for s in sorts]
    runner.capture(layout)
    runner.state.req_to_page = jax.device_put(page_table(args.prompt_requests, max(tokens), page, per,
                                                         args.prompt_requests + 1), runner.state.req_to_page.sharding)
    records = []
    for bucket in runner.buckets:
        plan = prompt_plan(bucket.num_tokens, min(args.prompt_requests, bucket.batch_size))
        for variant in variants(args):
            _report(f"=== variant {variant} tokens {bucket.num_tokens}", err=True)
            rec = {"preset": args.preset, "prompt_tokens": bucket.num_tokens, "requests": len(plan.reqs),
                   "sort": bucket.sort, "xla_flags": os.environ.get("XLA_FLAGS", ""), "variant": variant,
                   **probe(runner, bucket, pack(plan, bucket), args.reps, args.profile, "twins" in variant,
                           "stage" in variant, "arena" in variant)}
            _report(json.dumps(rec))
            records.append(rec)
    return records


def variants(args) -> list[str]:
    names = args.variants.split(",") if args.variants else ["twins" if args.twins else "plain"]
    for name in names:
        if not set(name.split("+")) <= {"plain", "twins", "stage", "arena"}:
            raise SystemExit(f"--variants: unknown variant {name!r} (plain, twins, stage, arena, joined by +)")
    if args.processes > 1 and any("twins" in n for n in names):
        raise SystemExit("--variants: twins loads a second copy over every device; not with --processes")
    return names


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompt-tokens", help="probe prompt steps of these token counts instead of decode")
    ap.add_argument("--prompt-requests", type=int, default=8)
    ap.add_argument("--sorts", default="None,True,False", help="the prompt buckets' sampler variants to probe")
    ap.add_argument("--profile", help="trace each bucket's back-to-back loop into this folder")
    ap.add_argument("--twins", action="store_true", help="alternate two loaded copies of each step")
    ap.add_argument("--variants", help="comma-separated: plain, twins, stage, arena, or several joined by + (overrides --twins)")
    ap.add_argument("--tp-size", type=int, default=1, help="devices the model is split over")
    ap.add_argument("--replicate-attention", action="store_true",
                    help="attention / GDN layers whole on every device (jspec.sharding)")
    ap.add_argument("--out")
    ap.add_argument("--processes", type=int, default=1,
                    help="multi-controller: this many processes, one device each (bench/multiprocess.py)")
    args = ap.parse_args(argv)
    variants(args)  # bad names fail here, before any process or model
    if args.processes > 1 and not multiprocess.is_rank():
        raise SystemExit(multiprocess.spawn(__file__, args.processes, sys.argv[1:] if argv is None else argv))
    global _REPORTS
    if multiprocess.is_rank() and multiprocess.join() > 0:  # every rank launches; rank 0 reports
        _REPORTS = False
        args.out = None
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model = random_model(parse_hf_config(preset_config(args.preset)), dtype="bfloat16", seed=0,
                         tp_size=args.tp_size, replicate_attention=args.replicate_attention)
    if args.prompt_tokens:
        _write(args.out, prompt_main(args, model))
        return
    page = 16
    per = -(-args.context // page)
    layout = PoolLayout(page_size=page, num_pages=max(batches) * per + 1, num_slots=max(batches) + 1,
                        pages_per_seq=per)
    runner = ModelRunner(model, layout=layout, decode_batch_sizes=batches, extend_token_sizes=[],
                         max_extend_requests=1, progress=False)
    fill_random_kv(runner, jax.random.PRNGKey(7))
    records = []
    for b in batches:
        bucket = next(x for x in runner.buckets if x.batch_size == b and not x.sort)
        runner.state.req_to_page = jax.device_put(page_table(b, args.context, page, per, max(batches) + 1),
                                                  runner.state.req_to_page.sharding)
        packed = pack(decode_plan(b, args.context), bucket)
        for variant in variants(args):
            _report(f"=== variant {variant} batch {b}", err=True)
            rec = {"preset": args.preset, "tp_size": args.tp_size, "replicate_attention": args.replicate_attention,
                   "processes": args.processes, "batch": b,
                   "context": args.context,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "variant": variant,
                   **probe(runner, bucket, packed, args.reps, args.profile, "twins" in variant, "stage" in variant,
                           "arena" in variant)}
            _report(json.dumps(rec))
            records.append(rec)
    _write(args.out, records)


_REPORTS = True  # False in the ranks of a multi-controller run other than 0


def _report(line: str, *, err: bool = False) -> None:
    """A line to stdout (stderr: a variant marker), from rank 0 only."""
    if _REPORTS:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


def _write(path: str | None, records: list[dict]) -> None:
    if path:
        append_jsonl(path, [{**r, "env": environment()} for r in records])


if __name__ == "__main__":
    main()
