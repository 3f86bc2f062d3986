"""Host cost of one call of a split-step part, whole against slim (`jspec.runtime.slim_part`): a
function of P parameter arrays and S donated state arrays that reads UP of the parameters and
writes US of the state arrays (the rest passed through, as the draft part passes the target's KV
pools), called back to back with the state fed from call to call; microseconds per call.

    python3 bench/slim_part_call.py [--params 400 --state 82 --reads 40 --writes 10 --calls 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec.runtime import slim_part  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=400)
    ap.add_argument("--state", type=int, default=82)
    ap.add_argument("--reads", type=int, default=40)
    ap.add_argument("--writes", type=int, default=10)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    params = tuple(jnp.full((8,), i, jnp.float32) for i in range(a.params))

    def part(params, state, x):
        kv = list(state["kv"])
        acc = sum(params[i] for i in range(a.reads))
        for j in range(a.writes):
            kv[j] = kv[j] + acc.sum() * x
        return {"kv": kv}, acc

    def fresh():
        return {"kv": [jnp.zeros((16,)) for _ in range(a.state)]}

    x = jnp.float32(1.0)
    whole = jax.jit(part, donate_argnums=(1,)).lower(params, fresh(), x).compile()
    slim = slim_part.lower(part, (params, fresh(), x), donate_argnums=(1,), out_shardings=None).compile()

    def per_call(fn) -> float:
        state = fresh()
        for _ in range(20):
            state, out = fn(params, state, x)
        out.block_until_ready()
        t = time.perf_counter()
        for _ in range(a.calls):
            state, out = fn(params, state, x)
        spent = time.perf_counter() - t
        out.block_until_ready()
        return spent / a.calls * 1e6

    print(f"# {jax.devices()[0].platform}, jax {jax.__version__}: {a.params} parameters ({a.reads} read), "
          f"{a.state} state arrays ({a.writes} written)")
    for r in range(a.rounds):
        print(f"round {r}: whole {per_call(whole):.1f} us  slim {per_call(slim):.1f} us per call")


if __name__ == "__main__":
    main()
