"""Triton or Mosaic GPU for the GDN state kernels? How fast each lowering streams the recurrent state.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 bench/kernels/gdn_state_probe.py --out bench/results/gdn_state_probe_<dev>.json

The decode, verify and commit kernels are memory-bound passes over the float32 state `[dk, dv]` of
each (request, value head), reached through the request's slot. Two probe kernels do only that
pass, with no arithmetic, on the decode benchmark's shape (32 requests x 32 heads, dk = dv = 128,
64 MiB read + 64 MiB written): each program reads one `[dk, BV]` block of its slot's state and
writes it to the output.
- "triton": pointer loads and stores (what the shipped kernels do around their math);
- "mosaic": a TMA copy into shared memory, a barrier wait, and a TMA copy out.
The shipped `gated_delta_rule_decode` (its math included) is timed in the same run, and every
figure is a fraction of a device copy measured there too. Probe outputs are checked to equal the
gathered states before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gdn as gb  # noqa: E402  (shapes, inputs, copy rate, timing of bench/kernels/gdn.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from pallas_kernels import gdn  # noqa: E402


def triton_stream(pool, slots, *, block_v=64, num_warps=4, interpret=False):
    """out[b] = pool[slots[b]], one `[dk, BV]` block per program, through pointer loads."""
    from jax.experimental.pallas import triton as plt

    _, hv, dk, dv = pool.shape
    batch = slots.shape[0]

    def kernel(slots_ref, pool_ref, o_ref):
        b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        cols = pl.ds(j * block_v, block_v)
        o_ref[b, h, :, cols] = pool_ref[slots_ref[b], h, :, cols]

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=1)}
    return pl.pallas_call(
        kernel, grid=(batch, hv, dv // block_v), in_specs=[any_spec, any_spec], out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((batch, hv, dk, dv), pool.dtype), interpret=interpret,
        name="gdn_probe_triton", **params,
    )(slots, pool)


def mosaic_stream(pool, slots, *, block_v=64):
    """The same pass as `triton_stream`, through TMA: GMEM -> SMEM -> GMEM per block."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _, hv, dk, dv = pool.shape
    batch = slots.shape[0]

    def kernel(slots_ref, pool_ref, o_ref, smem, bar):
        b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
        cols = pl.ds(j * block_v, block_v)
        plgpu.copy_gmem_to_smem(pool_ref.at[slots_ref[b], h, :, cols], smem, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(smem, o_ref.at[b, h, :, cols])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, hv, dk, dv), pool.dtype),
        scratch_types=[plgpu.SMEM((dk, block_v), pool.dtype), plgpu.Barrier(num_arrivals=1)],
        grid=(batch, hv, dv // block_v), grid_names=("b", "h", "j"),
    )(slots, pool)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gdn_state_probe.json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help="the Triton probe in interpret mode, tiny shapes")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if a.cpu_smoke:
        pool = jax.random.normal(jax.random.key(0), (6, 2, 8, 16), jnp.float32)
        slots = jnp.asarray([4, 1, 3], jnp.int32)
        out = triton_stream(pool, slots, block_v=8, interpret=True)
        assert bool(jnp.array_equal(out, pool[slots])), "probe copied the wrong blocks"
        print("cpu smoke ok")
        return
    res = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
           "commit": os.environ.get("JSPEC_COMMIT") or gb.git_commit(),
           "command": "PYTHONPATH=. python3 bench/kernels/gdn_state_probe.py " + " ".join(sys.argv[1:]),
           "timing": "bench/kernels/gdn.py time_calls: median over rounds of 50 calls on 4 rotated slot sets"}
    gb.bench_copy(res)
    batch, rot = 32, 4
    pool0 = 0.1 * jax.random.normal(jax.random.key(20), (batch * rot, gb.HV, gb.DK, gb.DV), jnp.float32)
    slot_sets = [jnp.asarray(jax.random.permutation(jax.random.key(r), batch * rot)[:batch], jnp.int32)
                 for r in range(rot)]
    state_bytes = batch * gb.HV * gb.DK * gb.DV * 4
    q, k, v, g, beta = gb.gdn_inputs(jax.random.key(21), batch, batch)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    has_init = jnp.ones((batch,), bool)
    decode = jax.jit(gdn.gated_delta_rule_decode, donate_argnums=(5,))

    def time_decode():
        ms, _ = gb.time_calls(lambda pool, i: decode(q, k, v, g, beta, pool, cu, slot_sets[i % rot], has_init)[1],
                              pool0 + 0, calls=50)
        return ms

    def time_probe(fn):
        f = jax.jit(fn)
        ms, _ = gb.time_calls(lambda acc, i: f(pool0, slot_sets[i % rot]), None, calls=50)
        return ms

    probes = {"shipped decode (with math)": None}
    for bv in (32, 64, 128):
        probes[f"triton bv{bv}"] = lambda pool, s, bv=bv: triton_stream(pool, s, block_v=bv)
        probes[f"mosaic bv{bv}"] = lambda pool, s, bv=bv: mosaic_stream(pool, s, block_v=bv)
    rows = {name: {"ms": []} for name in probes}
    res["probes"] = rows

    def save():
        res["elapsed_s"] = time.perf_counter() - t0
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    for rnd in range(a.rounds):
        for name, fn in probes.items():
            row = rows[name]
            if "error" in row:
                continue
            try:
                if fn is None:
                    row["ms"].append(time_decode())
                else:
                    if rnd == 0:
                        got = jax.jit(fn)(pool0, slot_sets[0])
                        if not bool(jnp.array_equal(got, pool0[slot_sets[0]])):
                            raise AssertionError("probe output is not the gathered states")
                    row["ms"].append(time_probe(fn))
                best = min(row["ms"])
                row["TBps"] = 2 * state_bytes / best / 1e9
                row["frac_of_copy"] = row["TBps"] / res["copy_TBps"]
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:600]
            gb.log(f"round {rnd} {name}: {row}")
            save()


if __name__ == "__main__":
    main()
