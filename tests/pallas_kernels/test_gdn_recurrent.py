"""Recurrent decode and draft-token verification (interpret mode) against the reference."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn
from pallas_kernels.gdn import reference as ref
from test_gdn_inputs import DIMS, assert_close, cu_from_lens, parents_of, random_slots, state_pool, token_inputs

S = 8


def make_case(seed, lens, num_tokens, has_initial=None):
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    batch = len(lens)
    cu = cu_from_lens(lens)
    if has_initial is None:
        has_initial = rng.random(batch) < 0.7
    slots = random_slots(rng, batch, S)
    q, k, v, g, beta = token_inputs(rng, num_tokens, cu[-1], **DIMS)
    pool = state_pool(rng, S, slots, has_initial, Hv=DIMS["Hv"], dk=DIMS["dk"], dv=DIMS["dv"])
    return tuple(jnp.asarray(x) for x in (q, k, v, g, beta, pool, cu, slots, np.asarray(has_initial)))


decode_fn = jax.jit(functools.partial(gdn.gated_delta_rule_decode, interpret=True))
decode_ref = jax.jit(ref.gated_delta_rule)


@pytest.mark.parametrize("seed", range(3))
def test_decode_one_token_per_request(seed):
    # The engine's promise: T == B, cu_seqlens = arange(B + 1).
    args = make_case(seed, [1] * 6, 6)
    o, pool = decode_fn(*args)
    ro, rpool = decode_ref(*args)
    assert_close(o, ro, what="o")
    assert_close(pool, rpool, what="pool")


def test_decode_kernel_handles_ragged_steps():
    # Not the decode contract, but the kernel stays exact for any ragged input: several tokens per
    # request, empty requests (nothing written) and padding tokens (zeros).
    for seed, lens in enumerate([[0, 3, 1, 2], [1, 0, 0, 1], [0, 0, 0, 0], [5, 1, 1, 1]]):
        args = make_case(10 + seed, lens, 9)
        o, pool = decode_fn(*args)
        ro, rpool = decode_ref(*args)
        assert_close(o, ro, what=f"o {lens}")
        assert_close(pool, rpool, what=f"pool {lens}")


B_VERIFY, N = 3, 5
verify_fn = jax.jit(functools.partial(gdn.gated_delta_rule_verify, interpret=True))
verify_ref = jax.jit(ref.gated_delta_rule_verify)


@pytest.mark.parametrize("kinds", [
    ("chain", "chain", "chain"),
    ("star", "star", "star"),
    ("tree", "tree", "tree"),
    ("chain", "two_branches", "tree"),
    ("two_branches", "star", "tree"),
])
def test_verify_tree(kinds):
    # Tree branches rebuild their parent's state in registers by replaying its path: every node's
    # output must still be the reference's, which keeps one state per node.
    rng = np.random.default_rng(zlib.crc32("-".join(kinds).encode()))
    parents = np.stack([parents_of(kind, rng, N) for kind in kinds]).astype(np.int32)
    slots = random_slots(rng, B_VERIFY, S)
    q, k, v, g, beta = token_inputs(rng, B_VERIFY * N, B_VERIFY * N, **DIMS)
    pool = state_pool(rng, S, slots, [True] * B_VERIFY, Hv=DIMS["Hv"], dk=DIMS["dk"], dv=DIMS["dv"])
    args = tuple(jnp.asarray(x) for x in (q, k, v, g, beta, pool, slots, parents))
    assert_close(verify_fn(*args), verify_ref(*args), what="o")


def test_ancestors():
    parents = jnp.asarray([[-1, 0, 1, 0, 3], [-1, -1, 1, 2, 0]], jnp.int32)
    want = np.zeros((2, 5, 5), bool)
    for b, paths in enumerate([[[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4]],
                               [[0], [1], [1, 2], [1, 2, 3], [0, 4]]]):
        for j, path in enumerate(paths):
            want[b, j, path] = True
    np.testing.assert_array_equal(ref.ancestors(parents), want)
    np.testing.assert_array_equal(ref.accepted_path(parents, jnp.asarray([4, -1])), [want[0, 4], [False] * 5])


def test_verify_single_token_matches_decode():
    # N = 1 verification is a decode step that leaves the pool alone.
    rng = np.random.default_rng(7)
    slots = random_slots(rng, 4, S)
    q, k, v, g, beta = token_inputs(rng, 4, 4, **DIMS)
    pool = state_pool(rng, S, slots, [True] * 4, Hv=DIMS["Hv"], dk=DIMS["dk"], dv=DIMS["dv"])
    parents = np.full((4, 1), -1, np.int32)
    args = tuple(jnp.asarray(x) for x in (q, k, v, g, beta, pool, slots, parents))
    o = jax.jit(functools.partial(gdn.gated_delta_rule_verify, interpret=True))(*args)
    do, _ = decode_ref(*(args[:6] + (jnp.arange(5, dtype=jnp.int32), args[6], jnp.ones(4, bool))))
    assert_close(o, do, what="o")
