"""The Pallas kernels inside `jax.shard_map` on the GPU, as a tensor-parallel step runs them.

A split target's kernels run per device under `shard_map` (`jspec.models.ops`). CPU tests cover
that in interpret mode only; this checks, on whatever GPUs are present (one is enough: a mesh of
one device takes the same lowering path), that every kernel lowers and runs inside `shard_map`
and matches the reference:
- a whole prompt forward of a small hybrid MoE model (paged attention, KV write, causal conv,
  chunked gated delta rule, MoE gather) with every kernel call mapped over the mesh;
- the MoE gather in its tensor-parallel form (per-device kernel + psum) and in its expert-parallel
  form (masked pairs + psum).

    python3 bench/shard_map_kernels.py --out $OUT/shard_map_kernels.json
"""

from __future__ import annotations

import argparse
import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.record import environment
from jspec.config import parse_hf_config
from jspec.models import dispatch, ops
from jspec.models.loader import random_model
from jspec.models.presets import preset_config
from jspec.sharding import make_mesh, to_tp_layout


@contextlib.contextmanager
def mapped(mesh):
    """Every kernel call maps over `mesh`, whatever the layer's tp (one device: tp 1 layers too)."""
    original = dispatch.per_device
    dispatch.per_device = lambda fn, tp, in_specs, out_specs: jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    try:
        with dispatch.tensor_parallel(mesh):
            yield
    finally:
        dispatch.per_device = original


def forward_under_shard_map(model, ids, mesh) -> np.ndarray:
    from jspec.models.scoring import jitted_forward

    jitted_forward.cache_clear()  # trace again with the mapped kernels
    try:
        with mapped(mesh):
            return model.score(ids)
    finally:
        jitted_forward.cache_clear()


def moe_split_forms(mesh) -> dict:
    """MoE gather with experts split whole and by intermediate dimension (per-device kernel +
    psum) against the reference. On one device the mapped forms are asked for with tp 2 so that
    they run (each sees the whole expert set and the tp = 1 layout: the same kernels, axis_index,
    masking and psum on a 1-device axis)."""
    tp = mesh.size
    one = tp == 1
    rng = np.random.default_rng(0)
    t, e, x_experts, inter, k = 8, 256, 8 * tp, 128, 2
    x = jnp.asarray(rng.standard_normal((t, e)), jnp.bfloat16)
    experts = jnp.asarray(rng.integers(0, x_experts, (t, k)), jnp.int32)
    weights = jnp.asarray(rng.random((t, k)), jnp.bfloat16)
    gate_up = rng.standard_normal((x_experts, e, 2 * inter)).astype(np.float32) * 0.05
    down = jnp.asarray(rng.standard_normal((x_experts, inter, e)) * 0.05, jnp.bfloat16)
    with dispatch.use_backend("reference"):
        ref = np.asarray(ops.moe_gather(x, experts, weights, jnp.asarray(gate_up, jnp.bfloat16), down), np.float32)
    gu_split = jnp.asarray(gate_up if one else to_tp_layout("model.layers.0.mlp.experts.gate_up_proj", gate_up,
                                                              None, tp), jnp.bfloat16)
    ctx = mapped(mesh) if one else dispatch.tensor_parallel(mesh)
    tp_arg = 2 if one else tp
    with ctx:
        ep = jax.jit(lambda *a: ops.moe_gather(*a, tp=tp_arg, expert_parallel=True))(
            x, experts, weights, jnp.asarray(gate_up, jnp.bfloat16), down)
        it = jax.jit(lambda *a: ops.moe_gather(*a, tp=tp_arg))(x, experts, weights, gu_split, down)
    return {"expert_parallel_max_abs_err": float(np.abs(np.asarray(ep, np.float32) - ref).max()),
            "intermediate_split_max_abs_err": float(np.abs(np.asarray(it, np.float32) - ref).max()),
            "reference_max_abs": float(np.abs(ref).max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args()
    tp = jax.device_count()
    mesh = make_mesh(tp)
    cfg = parse_hf_config({**preset_config("qwen3-next-12l"), "num_hidden_layers": 4, "num_experts": 64})
    model = random_model(cfg, dtype="bfloat16", seed=1)
    ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 200))
    with dispatch.use_backend("reference"):
        ref = model.score(ids)
    got = forward_under_shard_map(model, ids, make_mesh(1))
    plain = model.score(ids)
    rec = {**environment(), "backend": dispatch.backend(),
           "forward": {"max_abs_err_vs_reference": float(np.abs(got - ref).max()),
                       "unmapped_max_abs_err_vs_reference": float(np.abs(plain - ref).max()),
                       "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                       "mapped_equals_unmapped": bool(np.array_equal(got, plain))},
           "moe": moe_split_forms(mesh), "tp": tp}
    print(json.dumps(rec, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
