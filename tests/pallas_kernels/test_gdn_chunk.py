"""Chunked prefill (`pallas_kernels.gdn.gated_delta_rule`, interpret mode) against the reference.

Shapes are static per compiled function (T = 256 tokens, B = 5 requests, 8 slots), so hypothesis
and the fixed cases vary lengths, slots and has_initial without recompiling. Lengths cover empty
and single-token requests, exact chunk multiples, one-past and one-short of a chunk boundary, and
padding after the last request.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallas_kernels import gdn
from pallas_kernels.gdn import reference as ref
from pallas_kernels.gdn.chunk import ChunkConfig, chunk_table, first_chunk_slot
from pallas_kernels.gdn.chunk_prepare import unit_lower_inverse
from test_gdn_inputs import DIMS, assert_close, cu_from_lens, random_slots, state_pool, token_inputs

T, B, S = 256, 5, 8


@functools.cache
def kernel_fn(scale=None, use_qk_l2norm=True, config=None):
    return jax.jit(functools.partial(gdn.gated_delta_rule, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                     interpret=True, config=config))


@functools.cache
def reference_fn(scale=None, use_qk_l2norm=True):
    return jax.jit(functools.partial(ref.gated_delta_rule, scale=scale, use_qk_l2norm=use_qk_l2norm))


def make_case(seed, lens, has_initial=None, dtype=np.float32):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    cu = cu_from_lens(lens)
    if has_initial is None:
        has_initial = rng.random(B) < 0.6
    slots = random_slots(rng, B, S)
    q, k, v, g, beta = token_inputs(rng, T, cu[-1], **DIMS)
    pool = state_pool(rng, S, slots, has_initial, Hv=DIMS["Hv"], dk=DIMS["dk"], dv=DIMS["dv"])
    cast = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.asarray(g), cast(beta), jnp.asarray(pool), jnp.asarray(cu),
            jnp.asarray(slots), jnp.asarray(np.asarray(has_initial)))


def check(args, tol=1e-4, config=None, **kw):
    o, pool = kernel_fn(config=config, **kw)(*args)
    ro, rpool = reference_fn(**kw)(*args)
    assert_close(o, ro, tol=tol, what="o")
    assert_close(pool, rpool, tol=tol, what="state pool")


LENS = [
    [0, 1, 64, 65, 100],  # empty, single token, exact chunk, one past, partial; 26 padding tokens
    [256, 0, 0, 0, 0],  # one request filling the step, four chunks, no padding
    [63, 64, 1, 0, 127],  # one short of a boundary, 255 tokens
    [0, 0, 0, 0, 0],  # nothing at all: all padding
    [3, 129, 2, 1, 0],
]


# Both forms of the chunk terms (B = 5 requests would pick the stacked one by itself), with dv = 32
# in blocks of 16 so that two programs per (request, head) share the terms; the default config
# (stacked, one dv block) runs in the other tests.
STACKED = ChunkConfig(stacked=True, block_v=16)
PER_CHUNK = ChunkConfig(stacked=False, block_v=16)


@pytest.mark.parametrize("config", [STACKED, PER_CHUNK], ids=["stacked", "per_chunk"])
@pytest.mark.parametrize("lens", LENS)
def test_chunked_prefill_ragged(lens, config):
    check(make_case(sum(lens) + len(LENS), lens), config=config)


def test_chunked_prefill_all_fresh_and_all_continued():
    lens = [40, 70, 0, 1, 90]
    check(make_case(11, lens, has_initial=np.zeros(B, bool)))
    check(make_case(12, lens, has_initial=np.ones(B, bool)), config=PER_CHUNK)


def test_chunked_prefill_scale_without_l2norm():
    # Without normalisation keys are not unit vectors: keep them small so the recurrence stays tame.
    args = list(make_case(13, [10, 64, 0, 77, 5]))
    args[1] = args[1] * 0.25
    check(tuple(args), scale=0.1, use_qk_l2norm=False)
    check(tuple(args), scale=0.1, use_qk_l2norm=False, config=PER_CHUNK)


@pytest.mark.parametrize("config", [STACKED, PER_CHUNK], ids=["stacked", "per_chunk"])
def test_chunked_prefill_bfloat16_inputs(config):
    # The GPU path: 16-bit dot operands. Looser tolerance, compared against float32 math.
    args = make_case(14, [0, 1, 64, 65, 100], dtype=jnp.bfloat16)
    o, pool = kernel_fn(config=config)(*args)
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    ro, rpool = reference_fn()(*up)
    assert o.dtype == jnp.bfloat16
    assert_close(o, ro, tol=3e-2, what="o bf16")
    assert_close(pool, rpool, tol=3e-2, what="pool bf16")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 90), min_size=B, max_size=B).filter(lambda x: sum(x) <= T),
       st.integers(0, 2**31 - 1))
def test_chunked_prefill_property(lens, seed):
    check(make_case(seed, lens))


def test_chunk_table():
    lens = np.array([0, 1, 64, 65, 100], np.int32)
    start, length = jax.jit(chunk_table, static_argnums=1)(jnp.asarray(cu_from_lens(lens)), T)
    expect = [(0, 1), (1, 64), (65, 64), (129, 1), (130, 64), (194, 36)]
    got = [(int(s), int(n)) for s, n in zip(start, length) if n > 0]
    assert got == expect
    assert start.shape == (T // 64 + B,)
    assert [int(x) for x in first_chunk_slot(jnp.asarray(cu_from_lens(lens)))] == [0, 0, 1, 2, 4]


def test_form_and_block_choice():
    # Qwen3-Next heads: one request leaves the GPU idle in the state pass, eight fill it.
    cfg = ChunkConfig()
    assert cfg.use_stacked(1, 32, 128) and cfg.state_block_v(1, 32, 128) == 32
    assert not cfg.use_stacked(8, 32, 128) and cfg.state_block_v(8, 32, 128) == 64


def test_unit_lower_inverse_correlated_keys():
    # Strongly correlated keys and beta near 1: where a naive doubling formula blows up.
    rng = np.random.default_rng(3)
    k = rng.standard_normal((64, 32)) + 3.0 * rng.standard_normal(32)
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = rng.uniform(0.9, 1.0, 64)
    a = np.tril(beta[:, None] * (k @ k.T), -1).astype(np.float32)
    got = jax.jit(unit_lower_inverse)(jnp.asarray(a))
    want = np.linalg.inv(np.eye(64) + a.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


@pytest.mark.parametrize("config", [STACKED, PER_CHUNK], ids=["stacked", "per_chunk"])
def test_snapshot_rows_at_chunk_ends(config):
    """save_rows: the state after a 64-token chunk of a request also goes to a free pool row (a
    prefix-cache snapshot inside a prompt chunk), in the kernel as in the reference; and a snapshot
    is the state the request would have had, had it ended there."""
    lens = [130, 64, 1, 0, 60]
    args = make_case(21, lens, has_initial=np.array([True, False, True, False, True]))
    free = [r for r in range(S) if r not in set(np.asarray(args[7]).tolist())]
    saves = np.full(T, -1, np.int32)
    saves[63], saves[127], saves[130 + 63] = free  # two inside request 0, one at request 1's end
    saves = jnp.asarray(saves)
    o, pool = kernel_fn(config=config)(*args, save_rows=saves)
    ro, rpool = reference_fn()(*args, save_rows=saves)
    assert_close(o, ro, what="o")
    assert_close(pool, rpool, what="state pool")
    cut = list(args)
    cut[6] = jnp.asarray(cu_from_lens([64, 0, 0, 0, 0]))
    _, alone = reference_fn()(*cut)
    slot0 = int(args[7][0])
    assert_close(rpool[free[0]], alone[slot0], what="snapshot after 64 tokens")
    assert not np.isnan(np.asarray(pool[free[1]])).any()
