"""Tile plans of the expert-tiled gather kernels (pallas_kernels/moe/tiles.py), checked in numpy."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels.moe import tiles


def check_plan(experts, num_experts, block_m, tile_expert, tile_pairs, *, sorted_plan=True):
    experts = np.asarray(experts).reshape(-1)
    tile_expert, tile_pairs = np.asarray(tile_expert), np.asarray(tile_pairs)
    p = experts.size
    nt = tiles.max_tiles(p, num_experts, block_m) if sorted_plan else p
    assert tile_expert.shape == (nt,) and tile_pairs.shape == (nt, block_m)
    assert nt <= p
    live = tile_pairs >= 0
    # Every pair in exactly one tile.
    np.testing.assert_array_equal(np.sort(tile_pairs[live]), np.arange(p))
    used = tile_expert >= 0
    for i in range(nt):
        n = live[i].sum()
        if used[i]:
            assert n >= 1 and live[i, :n].all() and not live[i, n:].any()  # live rows first
            assert (experts[tile_pairs[i, :n]] == tile_expert[i]).all()  # one expert per tile
        else:
            assert n == 0 and (tile_expert[i] == -1)
    if sorted_plan:
        assert nt <= -(-p // block_m) + min(num_experts, p)
        assert not used[np.argmin(used):].any() or used.all()  # unused tiles only at the end
        counts = np.bincount(experts, minlength=num_experts)
        assert used.sum() == sum(-(-c // block_m) for c in counts)  # the fewest tiles per expert


@functools.lru_cache(maxsize=None)
def sorted_fn(num_experts, block_m):
    return jax.jit(functools.partial(tiles.sorted_tiles, num_experts=num_experts, block_m=block_m))


def routing(kind, t, k, x, rng):
    if kind == "distinct":  # every pair its own expert
        return rng.permutation(x)[: t * k].reshape(t, k)
    if kind == "topk":  # distinct within a token, shared across tokens
        return np.stack([rng.choice(x, size=k, replace=False) for _ in range(t)])
    if kind == "skewed":  # slot 0 of every token on expert 3 (and no other slot): t pairs there
        others = np.delete(np.arange(x), 3)
        e = np.stack([rng.choice(others, size=k, replace=False) for _ in range(t)])
        e[:, 0] = 3
        return e
    if kind == "one_expert":
        return np.full((t, k), x - 1)
    return rng.integers(0, x, (t, k))  # "any": repeats within a token too


@pytest.mark.parametrize("kind,t,k,x,block_m", [
    ("distinct", 1, 4, 8, 16), ("distinct", 12, 4, 64, 16), ("topk", 17, 4, 8, 4), ("skewed", 40, 3, 16, 16),
    ("one_expert", 50, 2, 8, 16), ("any", 33, 5, 7, 8), ("any", 64, 8, 512, 16), ("topk", 9, 3, 6, 1),
])
def test_sorted_tiles(kind, t, k, x, block_m):
    rng = np.random.default_rng(t * 31 + k)
    experts = routing(kind, t, k, x, rng).astype(np.int32)
    te, tp = sorted_fn(x, block_m)(experts.reshape(-1))
    check_plan(experts, x, block_m, te, tp)
    if kind == "skewed":  # 40 pairs on expert 3: tiles of 16, 16 and 8
        sizes = sorted((np.asarray(tp)[np.asarray(te) == 3] >= 0).sum(1))
        assert sizes == [8, 16, 16]


def test_bound_is_reached():
    # P <= X, all distinct: as many tiles as pairs; the bound min(P, ...) is exact.
    experts = np.arange(10, dtype=np.int32)
    te, tp = sorted_fn(512, 16)(experts)
    assert te.shape == (10,) and (np.asarray(te) >= 0).all()
    check_plan(experts, 512, 16, te, tp)


def test_pair_tiles():
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 5, 12).astype(np.int32)
    te, tp = tiles.pair_tiles(experts, 16)
    check_plan(experts, 5, 16, te, tp, sorted_plan=False)
    np.testing.assert_array_equal(np.asarray(te), experts)
    np.testing.assert_array_equal(np.asarray(tp)[:, 0], np.arange(12))
