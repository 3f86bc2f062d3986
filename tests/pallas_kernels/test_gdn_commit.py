"""Commit of the accepted draft step (interpret mode) against the reference, with donated pools."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn
from pallas_kernels.gdn import reference as ref
from test_gdn_inputs import assert_close, random_slots

S, B, N, HV, DK, DV, C, K = 8, 4, 3, 2, 16, 32, 24, 4


def make_case(seed, accepted, dk=DK):
    rng = np.random.default_rng(seed)
    state_pool = rng.standard_normal((S, HV, dk, DV)).astype(np.float32)
    conv_pool = rng.standard_normal((S, C, K - 1)).astype(np.float32)
    state_pool[0] = np.nan  # a poisoned slot nobody commits to must stay as it is
    slots = random_slots(rng, B, S - 1) + 1
    state_scratch = rng.standard_normal((B, N, HV, dk, DV)).astype(np.float32)
    conv_scratch = rng.standard_normal((B, N, C, K - 1)).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (state_pool, conv_pool, state_scratch, conv_scratch, slots,
                                          np.asarray(accepted, np.int32)))


@pytest.mark.parametrize("dk", [DK, 64])  # 64: the per-slot state is a whole number of copy blocks
def test_commit_accepted_and_kept(dk):
    for seed, accepted in enumerate([[-1, 0, 2, 1], [2, 2, -1, -1], [-1, -1, -1, -1], [0, 1, 2, 0]]):
        args = make_case(seed, accepted, dk)
        want = jax.jit(ref.commit)(*args)
        # Donating the pools, as the engine does: the kernel aliases them, so this runs in place.
        got = jax.jit(functools.partial(gdn.commit, interpret=True), donate_argnums=(0, 1))(*args)
        assert_close(got[0], want[0], tol=0, what=f"state pool {accepted}")
        assert_close(got[1], want[1], tol=0, what=f"conv pool {accepted}")


def test_commit_casts_conv_window_to_pool_dtype():
    args = list(make_case(9, [1, -1, 0, 2]))
    args[1] = args[1].astype(jnp.bfloat16)
    want = ref.commit(*args)
    got = jax.jit(functools.partial(gdn.commit, interpret=True))(*args)
    assert got[1].dtype == jnp.bfloat16
    assert_close(got[1], want[1], tol=0, what="conv pool bf16")
