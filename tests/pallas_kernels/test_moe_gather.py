"""Pallas routed-expert gather (interpret mode) against the jnp reference, every output element."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels.moe import reference as ref
from pallas_kernels.moe.gather_gemv import choose

X, E, I = 8, 64, 48  # I = 48: the down kernel's contracted size is not a power of two


def make_case(seed, t, k, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, E))
    gate_up = rng.standard_normal((X, E, 2 * I)) / np.sqrt(E)
    down = rng.standard_normal((X, I, E)) / np.sqrt(I)
    # Distinct experts within a token (as top-k gives), and the same experts again across tokens.
    pool = rng.permutation(X)[: max(k, 3)]
    experts = np.stack([rng.choice(pool, size=k, replace=False) for _ in range(t)])
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
def kernel_fn(t, k, mma, splits):
    up_cfg = choose(t * k, E, 2 * I, mode="up", mma=mma, splits=splits, **UP)
    down_cfg = choose(t * k, I, E, mode="down", mma=mma, splits=1 if splits == 1 else 3, **DOWN)
    return jax.jit(functools.partial(moe.moe_gather, interpret=True, up_cfg=up_cfg, down_cfg=down_cfg))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_reference(t, k, dtype):
    args = make_case(100 * t + k, t, k, dtype)
    mma = (t + k) % 2 == 0  # both product paths, spread over the cases
    splits = 2 if t != 3 else 1
    assert_matches(kernel_fn(t, k, mma, splits)(*args), jax.jit(ref.moe_gather)(*args), dtype)


@pytest.mark.parametrize("mma", [False, True])
def test_default_launch_shapes(mma):
    # The launch shapes `moe_gather` picks by itself (splits from the SM count), both product paths.
    args = make_case(7, 3, 4, jnp.float32)
    up_cfg = choose(12, E, 2 * I, mode="up", mma=mma)
    down_cfg = choose(12, I, E, mode="down", mma=mma)
    fn = jax.jit(lambda *a: moe.gather_gemv.moe_gather_pallas(*a, interpret=True, up_cfg=up_cfg, down_cfg=down_cfg))
    assert_matches(fn(*args), ref.moe_gather(*args), jnp.float32)
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


def test_ops_dispatch_and_module_path():
    # jspec's SparseMoE gather path goes through ops.moe_gather; the interpret backend runs the kernels.
    from jspec.models import ops

    args = make_case(3, 2, 2, jnp.float32)
    expected = ref.moe_gather(*args)
    with ops.use_backend("interpret"):
        assert_matches(jax.jit(ops.moe_gather)(*args), expected, jnp.float32)
    with ops.use_backend("reference"):
        np.testing.assert_array_equal(np.asarray(ops.moe_gather(*args)), np.asarray(expected))
