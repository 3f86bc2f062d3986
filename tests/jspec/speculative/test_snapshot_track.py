"""Which accepted-path node a speculative step snapshots for the hybrid prefix cache
(`step_common.snapshot_track`): the node whose state covers exactly `track_at` tokens, only when the
step's accepted run reaches it, on chains (node index = depth) and trees (the path's node at that depth)."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from jspec.speculative.step_common import snapshot_track


def _step(track_at, track_dst, l0, n, valid):
    arr = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    return SimpleNamespace(x={"track_at": arr(track_at), "track_dst": arr(track_dst)}, l0=arr(l0), n=arr(n),
                           valid=jnp.asarray(valid))


# Rows: the boundary is the root's length (l0 + 1), inside the run, its last token, one past it, before
# the step, no row, a padding row.
CASE = dict(track_at=[11, 22, 34, 35, 30, 33, 9], track_dst=[5, 6, 7, 8, 9, -1, 10],
            l0=[10, 20, 30, 30, 30, 30, 6], n=[2, 3, 3, 3, 3, 3, 3], valid=[True] * 6 + [False])


def test_chain_node_is_the_depth_reached():
    node, row = snapshot_track(_step(**CASE))
    np.testing.assert_array_equal(node, [0, 1, 3, -1, -1, -1, -1])
    np.testing.assert_array_equal(row, CASE["track_dst"])


def test_tree_node_is_the_accepted_path_node_at_that_depth():
    path = jnp.asarray([[0, 2, 5, 0], [0, 1, 4, 6], [0, 3, 4, 7], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3],
                        [0, 1, 2, 3]], jnp.int32)
    node, _ = snapshot_track(_step(**CASE), path)
    np.testing.assert_array_equal(node, [0, 1, 7, -1, -1, -1, -1])


def test_buckets_without_tracks_track_nothing():
    c = _step(**CASE)
    del c.x["track_at"]
    assert snapshot_track(c) is None
