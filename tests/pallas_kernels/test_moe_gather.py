"""Pallas expert-tiled routed-expert kernels (interpret mode) against the jnp reference, every output
element, over routings that exercise the tile plans: one pair per tile, all-distinct experts, an
expert shared across tile boundaries, repeated experts within a token, more pairs than experts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels.moe import reference as ref
from pallas_kernels.moe import tiles
from pallas_kernels.moe.gather_gemv import choose, moe_gather_pallas

X, E, I = 40, 64, 48  # I = 48: the down kernel's contracted size is not a power of two
SKEWED = 3  # the expert every token's first slot takes in the "skewed" routing


def routing(kind, t, k, rng):
    if kind == "distinct":  # every pair its own expert (needs t*k <= X)
        return rng.permutation(X)[: t * k].reshape(t, k)
    if kind == "topk":  # distinct within a token, a small pool shared across tokens
        pool = rng.permutation(X)[: max(k, 3)]
        return np.stack([rng.choice(pool, size=k, replace=False) for _ in range(t)])
    if kind == "skewed":  # t pairs on one expert (t > 16 crosses tile boundaries), the rest top-k-like
        others = np.delete(np.arange(X), SKEWED)
        e = np.stack([rng.choice(others, size=k, replace=False) for _ in range(t)])
        e[:, 0] = SKEWED
        return e
    assert kind == "repeats"  # repeats within a token (the contract allows them)
    return rng.integers(0, 4, (t, k))


def make_case(seed, t, k, dtype, kind="topk"):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, E))
    gate_up = rng.standard_normal((X, E, 2 * I)) / np.sqrt(E)
    down = rng.standard_normal((X, I, E)) / np.sqrt(I)
    experts = routing(kind, t, k, rng)
    weights = rng.random((t, k))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), jnp.asarray(experts, jnp.int32), cast(weights), cast(gate_up), cast(down)


def assert_matches(out, expected, dtype):
    out = np.asarray(out.astype(jnp.float32))
    expected = np.asarray(expected.astype(jnp.float32))
    assert out.shape == expected.shape and np.isfinite(out).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    else:  # intermediates rounded to bf16 at the same points; accumulation order differs
        np.testing.assert_allclose(out, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


# Small blocks so that the grids have several column tiles and splits, and loops several steps.
UP = dict(block_n=32, block_k=16)
DOWN = dict(block_n=32, block_k=16)


@functools.lru_cache(maxsize=None)
def kernel_fn(t, k, block_m, sort, splits):
    nt = tiles.max_tiles(t * k, X, block_m) if sort else t * k
    up_cfg = choose(nt, E, 2 * I, mode="up", splits=splits, **UP)
    down_cfg = choose(nt, I, E, mode="down", splits=1 if splits == 1 else 3, **DOWN)
    return jax.jit(functools.partial(moe.moe_gather, interpret=True, block_m=block_m, sort=sort, up_cfg=up_cfg,
                                     down_cfg=down_cfg))


CASES = [  # kind, T, K, block_m, sort (None: the default plan), splits
    ("distinct", 1, 4, 16, None, 2),  # one token: one pair per tile
    ("repeats", 3, 4, 16, True, 1),  # repeated experts within a token share a tile
    ("distinct", 17, 2, 16, True, 2),  # sorted, but every tile a single pair
    ("topk", 17, 2, 4, True, 2),  # a 3-expert pool: 11-12 pairs per expert, tiles of 4
    ("topk", 17, 2, 16, False, 2),  # one pair per tile with repeats across tokens
    ("skewed", 40, 2, 16, True, 2),  # 40 pairs on one expert (tiles 16, 16, 8); P = 80 > X
]


# bf16 on the routings where rounding meets tiling (T=1, repeats, skewed); interpret mode is slow.
PARAMS = [pytest.param(*c, d, id=f"{c[0]}-T{c[1]}-m{c[3]}-{c[4]}-{n}") for c in CASES
          for d, n in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")) if d == jnp.float32 or c[1] != 17]


@pytest.mark.parametrize("kind,t,k,block_m,sort,splits,dtype", PARAMS)
def test_matches_reference(kind, t, k, block_m, sort, splits, dtype):
    args = make_case(100 * t + k, t, k, dtype, kind)
    assert_matches(kernel_fn(t, k, block_m, sort, splits)(*args), jax.jit(ref.moe_gather)(*args), dtype)


@pytest.mark.parametrize("t,k", [(1, 4), (5, 2)])
def test_pair_plan_masked_row_gather(t, k):
    # With one pair per tile the kernels load each pair's input as one vector (tested above); the
    # generic masked row gather, kept to measure the two, must give the same result.
    args = make_case(7 * t + k, t, k, jnp.float32, "distinct")
    got = jax.jit(functools.partial(moe_gather_pallas, interpret=True, sort=False, single_row=False,
                                    up_cfg=choose(t * k, E, 2 * I, mode="up", splits=2, **UP),
                                    down_cfg=choose(t * k, I, E, mode="down", splits=3, **DOWN)))(*args)
    assert_matches(got, jax.jit(ref.moe_gather)(*args), jnp.float32)


@pytest.mark.parametrize("t,sorted_plan", [(3, False), (13, True)])
def test_default_launch_shapes(t, sorted_plan):
    # The launch shapes and plan `moe_gather` picks by itself (splits from the SM count, tiles of 16;
    # sorted tiles from 1.25 pairs per expert on, with the down kernel's wide column tiles).
    from pallas_kernels.moe import gather_gemv

    assert gather_gemv.sorts(t, 4, X) == sorted_plan
    args = make_case(7, t, 4, jnp.float32, "topk")
    out = jax.jit(functools.partial(moe.moe_gather, interpret=True))(*args)
    assert_matches(out, ref.moe_gather(*args), jnp.float32)


def test_unsupported_shapes_take_the_reference():
    x = jnp.ones((2, 20), jnp.float32)  # hidden size not a multiple of 16
    experts = jnp.asarray([[0, 1], [1, 0]], jnp.int32)
    w = jnp.full((2, 2), 0.5, jnp.float32)
    gate_up = jnp.full((2, 20, 8), 0.1, jnp.float32)
    down = jnp.full((2, 4, 20), 0.1, jnp.float32)
    np.testing.assert_array_equal(np.asarray(moe.moe_gather(x, experts, w, gate_up, down, interpret=True)),
                                  np.asarray(ref.moe_gather(x, experts, w, gate_up, down)))


def test_stacks_past_int32_offsets_take_the_kernels():
    # Qwen3.5-397B's gate_up stack (2**32 bf16 elements): the Triton lowering switches to 64-bit
    # offsets past 2**32 bytes, so size alone never sends a model to the reference (checked on a
    # GPU by bench/kernels/moe_large_stack_probe.py).
    from pallas_kernels.moe import gather_gemv

    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    gate_up = jax.ShapeDtypeStruct((512, 4096, 2048), jnp.bfloat16)
    down = jax.ShapeDtypeStruct((512, 1024, 4096), jnp.bfloat16)
    assert gate_up.size == 2**32 and gather_gemv.supported(x, gate_up, down)
    assert not gather_gemv.supported(jax.ShapeDtypeStruct((1, 4100), jnp.bfloat16), gate_up, down)


def test_ops_dispatch_and_module_path():
    # jspec's SparseMoE gather path goes through ops.moe_gather; the interpret backend runs the kernels.
    from jspec.models import dispatch, ops

    args = make_case(3, 2, 2, jnp.float32)
    expected = ref.moe_gather(*args)
    with dispatch.use_backend("interpret"):
        assert_matches(jax.jit(ops.moe_gather)(*args), expected, jnp.float32)
    with dispatch.use_backend("reference"):
        np.testing.assert_array_equal(np.asarray(ops.moe_gather(*args)), np.asarray(expected))
