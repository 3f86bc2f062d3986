"""NCCL's own all-reduce latency, without XLA: the figure `bench/allreduce.py` is set beside.

The GPU machines have no `nccl-tests`; PyTorch's NCCL process group calls `ncclAllReduce` directly,
so a chain of `--chain` in-place all-reduces of one buffer (each depends on the one before, as a
tensor-parallel step's do) timed with CUDA events gives NCCL's own latency per all-reduce for the
same bytes, eagerly launched and captured in one CUDA graph (what SGLang's decode graphs run).
One process per GPU (`torch.multiprocessing`), rank 0 reports.

    python3 bench/nccl_allreduce.py --out $OUT/nccl_allreduce.json [--sizes 8192,262144] [--chain 72]

Bus bandwidth as NCCL defines it: 2 (n-1)/n x bytes / time. Run under NCCL_PROTO / NCCL_ALGO to
compare protocols; each run records its NCCL_* environment.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_ms(torch, run, reps: int) -> float:
    """Median ms of `run()` over reps, by CUDA events around each call."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def worker(rank: int, world: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    records = []
    for size in (int(s) for s in args.sizes.split(",")):
        x = torch.zeros(max(1, size // dtype.itemsize), dtype=dtype, device="cuda")

        def chain():
            for _ in range(args.chain):
                dist.all_reduce(x)

        for _ in range(3):
            chain()
        torch.cuda.synchronize()
        eager = _time_ms(torch, chain, args.reps) / args.chain
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # NCCL in a graph: warmed up and captured off the default stream
            chain()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=side):
                chain()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        captured = _time_ms(torch, graph.replay, args.reps) / args.chain
        nbytes = x.numel() * x.element_size()
        bus = lambda ms: 2 * (world - 1) / world * nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        records.append({"bytes": nbytes, "us_eager": eager * 1e3, "us_graph": captured * 1e3,
                        "bus_gb_s_eager": bus(eager), "bus_gb_s_graph": bus(captured)})
        if rank == 0:
            print(f"{nbytes:>10} B  eager {eager * 1e3:7.1f} us  graph {captured * 1e3:7.1f} us  "
                  f"bus {bus(captured):7.1f} GB/s", flush=True)
        del graph
    dist.destroy_process_group()
    if rank == 0:
        queue.put(records)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8192,65536,262144,2097152,16777216", help="bytes per all-reduce")
    p.add_argument("--chain", type=int, default=72, help="dependent all-reduces per timed call")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpus", type=int, help="default: every visible GPU")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    world = args.gpus or torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {world}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(world, _free_port(), args, queue), nprocs=world, start_method="spawn")
    out = {"command": "python3 bench/nccl_allreduce.py " + " ".join(sys.argv[1:]), "gpus": world,
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "chain": args.chain,
           "commit": os.environ.get("JSPEC_COMMIT"),
           "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}, "records": queue.get()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
