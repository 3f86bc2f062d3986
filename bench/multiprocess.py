"""One benchmark program run multi-controller on this host: N processes, one device each, joined
by `jax.distributed` over localhost (the layout a multi-host deployment has, and the one where
each process launches only its own device's work).

    if args.processes > 1 and not multiprocess.is_rank():
        raise SystemExit(multiprocess.spawn(__file__, args.processes, sys.argv[1:]))
    rank = multiprocess.join() if multiprocess.is_rank() else 0

On CPU (to try the programs here) the processes reduce through gloo, JAX's default for CPU
collectives across processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax

_RANK, _WORLD, _COORD = "JSPEC_MP_RANK", "JSPEC_MP_WORLD", "JSPEC_MP_COORD"


def is_rank() -> bool:
    """Whether this process is one of a spawned job's ranks."""
    return _RANK in os.environ


def spawn(script: str, processes: int, argv: list[str]) -> int:
    """Run `script` with argv as `processes` ranks of one job; returns the worst exit status."""
    port = 20000 + os.getpid() % 20000
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script), *argv],
                              env={**os.environ, _RANK: str(r), _WORLD: str(processes), _COORD: f"127.0.0.1:{port}"})
             for r in range(processes)]
    return max(p.wait() for p in procs)


def join() -> int:
    """Join the job this rank was spawned into (its one local device: the rank's); returns the rank."""
    rank = int(os.environ[_RANK])
    jax.distributed.initialize(os.environ[_COORD], int(os.environ[_WORLD]), rank, local_device_ids=[rank])
    return rank
