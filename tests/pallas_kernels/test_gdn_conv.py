"""Causal conv1d (ragged prefill and draft-token verify, interpret mode) against the reference.

C = 24 channels is not a power of two and the kernels run with small blocks here (8 tokens, 16
channels), so partial token and channel blocks and several blocks per axis are all exercised.
Requests shorter than K - 1 = 3 tokens mix the stored window with new inputs.
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
from test_gdn_inputs import assert_close, conv_pool, cu_from_lens, parents_of, random_slots

T, B, S, C, K = 40, 5, 8, 24, 4

conv_fn = jax.jit(functools.partial(gdn.causal_conv1d, interpret=True, block_t=8, block_c=16))
# Channel blocks that tile C exactly take the unmasked-column path (the GPU's, C = 8192).
conv_fn_whole = jax.jit(functools.partial(gdn.causal_conv1d, interpret=True, block_t=16, block_c=8))
conv_ref = jax.jit(ref.causal_conv1d)


def make_case(seed, lens, has_initial=None):
    rng = np.random.default_rng(seed)
    cu = cu_from_lens(lens)
    if has_initial is None:
        has_initial = rng.random(B) < 0.6
    slots = random_slots(rng, B, S)
    x = rng.standard_normal((T, C)).astype(np.float32)
    x[cu[-1]:] = np.nan
    weight = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    pool = conv_pool(rng, S, slots, has_initial, C, K)
    return tuple(jnp.asarray(a) for a in (x, weight, pool, cu, slots, np.asarray(has_initial)))


def check(args, fn=conv_fn):
    y, pool = fn(*args)
    ry, rpool = conv_ref(*args)
    assert_close(y, ry, what="y")
    assert_close(pool, rpool, what="conv pool")


@pytest.mark.parametrize("lens", [
    [0, 1, 2, 5, 20],  # shorter than the window, exactly the window, longer
    [40, 0, 0, 0, 0],
    [3, 3, 3, 3, 3],
    [0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1],  # decode-shaped step
])
def test_conv_ragged(lens):
    check(make_case(sum(lens), lens))
    check(make_case(sum(lens) + 1, lens), conv_fn_whole)


def test_conv_all_fresh_and_all_continued():
    check(make_case(1, [2, 7, 0, 1, 9], has_initial=np.zeros(B, bool)))
    check(make_case(2, [2, 7, 0, 1, 9], has_initial=np.ones(B, bool)))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 12), min_size=B, max_size=B).filter(lambda x: sum(x) <= T),
       st.integers(0, 2**31 - 1))
def test_conv_property(lens, seed):
    check(make_case(seed, lens))


B_VERIFY, N = 3, 5
verify_fn = jax.jit(functools.partial(gdn.causal_conv1d_verify, interpret=True, block_c=16))
verify_fn_whole = jax.jit(functools.partial(gdn.causal_conv1d_verify, interpret=True, block_c=8))
verify_ref = jax.jit(ref.causal_conv1d_verify)


@pytest.mark.parametrize("kinds", [
    ("chain", "chain", "chain"),
    ("star", "tree", "two_branches"),
    ("tree", "tree", "tree"),
])
def test_conv_verify_tree(kinds):
    rng = np.random.default_rng(len(kinds[0]) * 7 + len(kinds[1]))
    parents = np.stack([parents_of(kind, rng, N) for kind in kinds]).astype(np.int32)
    slots = random_slots(rng, B_VERIFY, S)
    x = rng.standard_normal((B_VERIFY * N, C)).astype(np.float32)
    weight = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    pool = conv_pool(rng, S, slots, [True] * B_VERIFY, C, K)
    args = tuple(jnp.asarray(a) for a in (x, weight, pool, slots, parents))
    ry, rscratch = verify_ref(*args)
    for fn in (verify_fn, verify_fn_whole):
        y, scratch = fn(*args)
        assert_close(y, ry, what="y")
        assert_close(scratch, rscratch, what="window scratch")


def test_saved_windows_are_the_windows_of_a_request_ending_there():
    """`reference.save_conv_windows` (prefix-cache snapshots inside a prompt chunk): the window after
    token t is the one `causal_conv1d` leaves a request whose chunk ends at t."""
    x, weight, pool, _, slots, has_initial = make_case(31, [20, 15, 0, 0, 0], has_initial=np.ones(B, bool))
    free = [r for r in range(S) if r not in set(np.asarray(slots).tolist())]
    saved = jax.jit(ref.save_conv_windows)(pool, x, jnp.asarray([9, 20 + 14, 3], jnp.int32),
                                           jnp.asarray([free[0], free[1], -1], jnp.int32))
    for token, end, row in ((9, [10, 0, 0, 0, 0], free[0]), (34, [20, 15, 0, 0, 0], free[1])):
        _, alone = conv_ref(x, weight, pool, jnp.asarray(cu_from_lens(end)), slots, has_initial)
        b = 0 if token < 20 else 1
        assert_close(saved[row], alone[int(slots[b])], what=f"window after {token}")
    untouched = [r for r in range(S) if r not in free[:2]]
    assert_close(saved[jnp.asarray(untouched)], pool[jnp.asarray(untouched)], what="other rows")
