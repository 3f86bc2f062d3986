"""All-reduce latency inside one jitted program, as a tensor-parallel decode step pays it.

A split decode step does two all-reduces per layer (after o_proj / out_proj and after the MLP's
down_proj), each of batch x hidden elements, one after another: their latency, not their
bandwidth, is what a batch-1 step pays. This times a chain of `--chain` dependent all-reduces
(`psum` under `shard_map`, which XLA lowers to NCCL on GPU) per message size and reports
microseconds per all-reduce and the bus bandwidth (NCCL's definition: 2 (n-1)/n x bytes / time), so
it can be set beside `nccl-tests`' all_reduce_perf for the same bytes.

    python3 bench/allreduce.py --out $OUT/allreduce.json [--sizes 8192,262144,2097152] [--chain 72]

`--impl` picks the all-reduce: `psum` (XLA's, NCCL) or `oneshot` / `oneshot_handshake` (jspec's
Mosaic GPU kernel reading every peer's buffer over NVLink, `pallas_kernels/all_reduce`); several,
comma-separated, are timed in one run, the kernel checked against `psum`'s result. `--profile DIR` also writes a trace of each
(implementation, size) point for `bench/trace_summary.py` (device time vs host overhead).

Run it under different XLA / NCCL settings (e.g. NCCL_PROTO=LL, NCCL_ALGO=Ring|Tree,
--xla_gpu_enable_nccl_user_buffers) to compare; each run records its environment.

`--in-place` writes each program's result into a donated buffer that the next call gets back (so no
buffer the program touches moves between calls and XLA never re-records its command buffers): with
`XLA_FLAGS=--xla_gpu_enable_command_buffer=+COLLECTIVES` that is what a whole tensor-parallel step
captured as one graph, all-reduces included, would cost per all-reduce.

`--processes N` runs the same chain multi-controller: N processes on this host, one GPU each, joined
by `jax.distributed` over localhost (the layout a multi-host deployment has, and the one NVSHMEM
needs: one device per process, `--xla_gpu_experimental_enable_nvshmem=true`). Process 0 reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bench import multiprocess
from jspec.bench.record import environment
from jspec.sharding import TP, make_mesh


def reducer(impl: str, n: int):
    """The all-reduce `impl` of a per-device block under shard_map over the `tp` axis."""
    if impl == "psum":
        return lambda x: jax.lax.psum(x, TP)
    from pallas_kernels.all_reduce.kernel import one_shot_all_reduce

    if impl in ("oneshot", "oneshot_handshake"):
        return lambda x: one_shot_all_reduce(x, TP, n, handshake=impl == "oneshot_handshake")
    raise ValueError(f"--impl {impl!r}: psum, oneshot or oneshot_handshake")


def chain_fn(mesh, chain: int, impl: str = "psum"):
    """x `[n * rows, cols]` sharded by rows -> after `chain` all-reduces, each fed the previous."""
    reduce = reducer(impl, mesh.size)

    def body(x):
        for _ in range(chain):
            x = reduce(x) * (1.0 / mesh.size)  # keeps the values bounded
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(TP), out_specs=P(TP), check_vma=False))


class InPlace:
    """`chain(x)` with its result written into one donated buffer, handed back call after call:
    the same addresses every time (see the module doc)."""

    def __init__(self, chain, x):
        self.buf = jnp.zeros_like(x)
        self.fn = jax.jit(lambda x, buf: jax.lax.dynamic_update_slice(buf, chain(x), (0,) * x.ndim),
                          donate_argnums=(1,), out_shardings=x.sharding)

    def __call__(self, x):
        self.buf = self.fn(x, self.buf)
        return self.buf


def global_rows(mesh, host: np.ndarray):
    """`host` [n, cols] as one array sharded by rows over the mesh (every process holds its own rows)."""
    sharding = NamedSharding(mesh, P(TP))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def local_rows(x) -> np.ndarray:
    return np.concatenate([np.asarray(s.data, np.float32) for s in x.addressable_shards])


def time_chain(fn, x, reps: int = 20) -> float:
    fn(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp-size", type=int, help="devices in the all-reduce (default: all)")
    p.add_argument("--processes", type=int, default=1,
                   help="run multi-controller: this many processes, one GPU each (jax.distributed)")
    p.add_argument("--sizes", default="8192,65536,262144,2097152,16777216", help="bytes per all-reduce")
    p.add_argument("--chain", type=int, default=72, help="dependent all-reduces per program (Qwen3-8B: 72)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impl", default="psum", help="psum, oneshot, oneshot_handshake; comma-separated")
    p.add_argument("--in-place", action="store_true", help="results into one donated buffer (stable addresses)")
    p.add_argument("--profile", help="write a trace of each point under this folder")
    p.add_argument("--out")
    args = p.parse_args()
    if args.processes > 1 and not multiprocess.is_rank():
        raise SystemExit(multiprocess.spawn(__file__, args.processes, sys.argv[1:]))
    rank = multiprocess.join() if multiprocess.is_rank() else 0
    args.tp_size = args.tp_size or len(jax.devices())
    mesh = make_mesh(args.tp_size)
    dtype = jnp.dtype(args.dtype)
    records = []
    for size in (int(s) for s in args.sizes.split(",")):
        cols = max(1, size // dtype.itemsize)
        x = global_rows(mesh, np.asarray(jax.random.normal(jax.random.key(0), (args.tp_size, cols), dtype)))
        want = None
        for impl in args.impl.split(","):
            rec = {"impl": impl, "bytes": cols * dtype.itemsize}
            try:
                fn = chain_fn(mesh, args.chain, impl)
                if args.in_place:
                    fn = InPlace(fn, x)
                got = local_rows(fn(x))
                if impl == "psum":
                    want = got
                elif want is not None:
                    rec["max_abs_diff_vs_psum"] = float(np.abs(got - want).max())
                sec = time_chain(fn, x) / args.chain
                if args.profile:
                    where = os.path.join(args.profile, f"{impl}_{rec['bytes']}")
                    with jax.profiler.trace(where, create_perfetto_trace=True):
                        for _ in range(5):
                            fn(x).block_until_ready()
            except Exception as e:  # one implementation failing must not lose the others' figures
                rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                print(f"{impl:>9} {rec['bytes']:>10} B  failed: {rec['error'][:400]}")
                records.append(rec)
                continue
            n = args.tp_size
            rec.update(us_per_allreduce=sec * 1e6,
                       bus_bandwidth_gb_s=2 * (n - 1) / n * cols * dtype.itemsize / sec / 1e9)
            records.append(rec)
            if rank == 0:
                print(f"{impl:>9} {rec['bytes']:>10} B  {rec['us_per_allreduce']:8.1f} us  "
                      f"{rec['bus_bandwidth_gb_s']:8.1f} GB/s bus  {rec.get('max_abs_diff_vs_psum', '')}")
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
             if k != "out" and v is not None and v is not False]
    out = {"command": "python3 bench/allreduce.py " + " ".join(flags),
           **environment(), "tp_size": args.tp_size, "chain": args.chain, "processes": args.processes,
           "in_place": args.in_place,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "XLA_"))}, "records": records}
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
