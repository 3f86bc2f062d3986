"""Tree acceptance (`jspec.speculative.tree.walk`) in isolation: many independent rows of one call, each
with its own random key, so the law of the emitted tokens can be checked precisely.

With point-mass drafts the first emitted token (the accepted child, or else the bonus) must follow
the root's distribution p exactly, whatever the children; given an accepted child, the next token
must follow that child's distribution. Greedy rows follow the argmax path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec.runtime.sampler import SamplingBatch
from jspec.speculative import tree

ROWS = 20000


def _batch(b, temperature):
    f = jnp.full((b,), 1.0, jnp.float32)
    return SamplingBatch(temperature=f * temperature, top_p=f, top_k=jnp.full((b,), -1, jnp.int32),
                         min_p=f * 0, repetition_penalty=f, frequency_penalty=f * 0, presence_penalty=f * 0,
                         seed=jnp.arange(b, dtype=jnp.int32), step=jnp.zeros((b,), jnp.int32))


def _walk(p_nodes, tokens, parents, temperature=1.0):
    """p_nodes `[N, V]` target probabilities per node (same for every row)."""
    n, v = p_nodes.shape
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p_nodes, jnp.float32)), (ROWS, n, v))
    toks = jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (ROWS, n))
    par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (ROWS, n))
    sb = _batch(ROWS, temperature)
    greedy = sb.temperature < 1e-5
    base = jax.random.PRNGKey(7)

    def key_fn(k):
        return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), k))(jnp.arange(ROWS))

    depth = int(max(len(_ancestors(parents, j)) for j in range(n)))
    path, kept, bonus = jax.jit(lambda lg, t, p: tree.walk(lg, t, p, sb, greedy, key_fn, depth, sort=False))(
        logits, toks, par)
    path, kept, bonus = np.asarray(path), np.asarray(kept), np.asarray(bonus)
    emitted = np.where(kept[:, None] > np.arange(depth)[None, :], np.asarray(tokens)[path[:, 1:]], -1)
    first = np.where(kept > 0, emitted[:, 0], bonus)
    return path, kept, bonus, first


def _ancestors(parents, j):
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out


def _chi2(counts, p):
    exp = p * counts.sum()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    chi2 = float(np.sum((counts[keep] - exp[keep]) ** 2 / exp[keep]))
    return stats.chi2.sf(chi2, df=int(keep.sum()) - 1)


P_ROOT = np.array([0.45, 0.3, 0.15, 0.06, 0.04])
P_OTHER = np.array([0.1, 0.2, 0.3, 0.25, 0.15])


@pytest.mark.parametrize("children", [[0, 1], [1, 0, 2], [3, 4], [2]])
def test_first_token_follows_the_root_distribution(children):
    n = 1 + len(children)
    p_nodes = np.stack([P_ROOT] + [P_OTHER] * len(children))
    _, _, _, first = _walk(p_nodes, [0] + children, [-1] + [0] * len(children))
    assert _chi2(np.bincount(first, minlength=5).astype(float), P_ROOT) > 1e-3
    assert n >= 2


def test_second_token_follows_the_accepted_childs_distribution():
    # root -> children 0, 1; child 0 -> grandchildren 2, 3.
    p_child0 = np.array([0.05, 0.05, 0.5, 0.3, 0.1])
    p_nodes = np.stack([P_ROOT, p_child0, P_OTHER, P_OTHER, P_OTHER])
    path, kept, bonus, first = _walk(p_nodes, [0, 0, 1, 2, 3], [-1, 0, 0, 1, 1])
    tokens = np.array([0, 0, 1, 2, 3])
    rows = first == 0  # the child carrying token 0 was accepted
    second = np.where(kept[rows] >= 2, tokens[path[rows, 2]], bonus[rows])
    assert _chi2(np.bincount(second, minlength=5).astype(float), p_child0) > 1e-3


def test_greedy_follows_the_argmax_path():
    p_child0 = np.array([0.05, 0.05, 0.2, 0.6, 0.1])
    p_nodes = np.stack([P_ROOT, p_child0, P_OTHER, P_OTHER, P_OTHER])
    path, kept, bonus, _ = _walk(p_nodes, [0, 0, 1, 2, 3], [-1, 0, 0, 1, 1], temperature=0.0)
    assert (kept == 2).all() and (path[:, 1] == 1).all() and (path[:, 2] == 4).all()
    assert (bonus == 2).all()  # argmax of node 4's distribution (P_OTHER)
