"""Commit of the accepted draft node (interpret mode): the replayed state and the copied conv window
against the reference, with donated pools, on chains and trees."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn
from pallas_kernels.gdn import reference as ref
from test_gdn_inputs import DIMS, assert_close, parents_of, random_slots, state_pool, token_inputs

S, B, N, C, K = 8, 4, 5, 24, 4

commit_fn = jax.jit(functools.partial(gdn.commit, interpret=True), donate_argnums=(0, 1))
commit_ref = jax.jit(ref.commit)


def make_case(seed, kinds, accepted, dims=DIMS, conv_dtype=np.float32, channels=C, rows=S):
    rng = np.random.default_rng(seed)
    parents = np.stack([parents_of(kind, rng, N) for kind in kinds]).astype(np.int32)
    slots = random_slots(rng, B, S - 1) + 1  # slot 0 is poisoned and nobody commits to it
    q, k, v, g, beta = token_inputs(rng, B * N, B * N, **dims)
    pool = state_pool(rng, rows, slots, [True] * B, Hv=dims["Hv"], dk=dims["dk"], dv=dims["dv"])
    conv_pool = np.full((rows, channels, K - 1), np.nan, np.float32)
    conv_pool[slots] = rng.standard_normal((B, channels, K - 1))
    conv_scratch = rng.standard_normal((B, N, channels, K - 1)).astype(np.float32)
    parents, accepted = jnp.asarray(parents), jnp.asarray(accepted, jnp.int32)
    path = ref.accepted_path(parents, accepted)
    tokens = dict(q=q, k=k, v=v, g=g, beta=beta)
    args = (jnp.asarray(pool), jnp.asarray(conv_pool).astype(conv_dtype), jnp.asarray(conv_scratch),
            *(jnp.asarray(x) for x in (k, v, g, beta)), jnp.asarray(slots), path, accepted)
    return args, parents, tokens


KINDS = [("chain",) * 4, ("tree", "star", "two_branches", "chain"), ("tree",) * 4]


@pytest.mark.parametrize("kinds", KINDS, ids=lambda k: "-".join(k))
def test_commit_replays_the_accepted_path(kinds):
    for accepted in ([-1, 0, 4, 2], [4, 3, -1, -1], [-1] * B, [1, 4, 0, 3]):
        args, _, _ = make_case(zlib.crc32("-".join(kinds).encode()), kinds, accepted)
        want = commit_ref(*args)
        got = commit_fn(*args)  # donated pools, as the engine passes them: the kernel runs in place
        assert_close(got[0], want[0], what=f"state pool {kinds} {accepted}")
        assert_close(got[1], want[1], tol=0, what=f"conv pool {kinds} {accepted}")


def test_commit_equals_the_verified_node_state():
    # The replayed state of node j equals the state verify reached at node j: decode the
    # committed state plus node j's path token by token with the recurrent reference.
    kinds = ("tree", "two_branches", "star", "chain")
    accepted = [3, 4, 2, 4]
    args, parents, tok = make_case(5, kinds, accepted)
    pool0 = np.asarray(args[0])  # before the donating call
    got = commit_fn(*args)[0]
    for b in range(B):
        p = np.asarray(parents[b])
        path, j = [], accepted[b]
        while j >= 0:
            path.append(j)
            j = int(p[j])
        rows = [b * N + i for i in reversed(path)]
        slot = int(args[7][b])
        sub = {name: jnp.asarray(x[rows]) for name, x in tok.items()}
        _, pool = ref.gated_delta_rule(sub["q"], sub["k"], sub["v"], sub["g"], sub["beta"], jnp.asarray(pool0),
                                       jnp.asarray([0, len(rows)], jnp.int32), jnp.asarray([slot], jnp.int32),
                                       jnp.asarray([True]))
        assert_close(np.asarray(got)[slot], np.asarray(pool)[slot], what=f"request {b} path {path[::-1]}")


def test_commit_conv_window_in_pool_dtype_and_wide_conv():
    # A bf16 conv pool, and a conv window wider than one copy block per program (several passes).
    dims = dict(Hk=1, Hv=1, dk=16, dv=16)
    # 700 x 3 = 2100 window elements over one program per request: 9 passes of 256, the last partial.
    args, _, _ = make_case(9, KINDS[1], [1, -1, 0, 2], dims=dims, conv_dtype=jnp.bfloat16, channels=700)
    want = ref.commit(*args)
    got = jax.jit(functools.partial(gdn.commit, interpret=True))(*args)
    assert got[1].dtype == jnp.bfloat16
    assert_close(got[1], want[1], tol=0, what="conv pool bf16")
    assert_close(got[0], want[0], what="state pool")


def ancestor_at(parents, node, depth):
    """The node at `depth` (root 0) on the path from the committed state to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1][depth]


@pytest.mark.parametrize("kinds", KINDS[1:], ids=lambda k: "-".join(k))
def test_commit_tracks_a_path_node_into_a_snapshot_row(kinds):
    # Rows S .. S + B - 1 are snapshot rows (NaN until written); request 1 tracks nothing, request 3
    # is not committed at all (its track must be ignored too).
    accepted = [4, 3, 2, -1]
    args, parents, _ = make_case(11, kinds, accepted, rows=S + B)
    p = np.asarray(parents)
    node = [ancestor_at(p[0], 4, 1), -1, 2, 0]
    track_node = jnp.asarray(node, jnp.int32)
    track_dst = jnp.asarray([S, S + 1, S + 2, S + 3], jnp.int32)
    want = commit_ref(*args, track_node, track_dst)
    got = commit_fn(*args, track_node, track_dst)
    assert_close(got[0], want[0], what=f"state pool {kinds}")
    assert_close(got[1], want[1], tol=0, what=f"conv pool {kinds}")
    state, conv = np.asarray(want[0]), np.asarray(want[1])
    assert np.isnan(state[S + 1]).all() and np.isnan(state[S + 3]).all(), "an untracked row was written"
    # A tracked row holds exactly what committing the tracked node itself would have left in the slot.
    args2, _, _ = make_case(11, kinds, [node[0], -1, node[2], -1], rows=S + B)
    alone = commit_ref(*args2)
    slots = np.asarray(args[7])
    for b, row in ((0, S), (2, S + 2)):
        assert_close(state[row], np.asarray(alone[0])[slots[b]], what=f"tracked state of request {b}")
        assert_close(conv[row], np.asarray(alone[1])[slots[b]], tol=0, what=f"tracked conv window of request {b}")
