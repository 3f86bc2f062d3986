"""The verify forward, KV move and hybrid-state commit of a speculative step, at the model level.

Two requests are prefilled through NaN-poisoned random pages; one verifies a chain, the other a
tree. Every node's verify logits must equal the logits of scoring prompt + the node's root path
as one plain sequence; after accepting a node (moving its path's KV into place and committing its
Gated-DeltaNet state) the next decode step must again equal plain scoring. A commit of the wrong
node, a leaked rejected state, or a wrong tree mask shows up as a mismatch.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.batch import ForwardMode
from jspec.models.loader import load_model
from jspec.models.scoring import forward
from jspec.speculative import tree, verify
from jspec.speculative.tree_step import move_kv
from tests.support import models as tm
from tests.support.paged import PagedHarness

PAGE = 4
PROMPTS = {"a": tm.random_ids(9, seed=3), "b": tm.random_ids(6, seed=4)}
# Node 0 is the request's last prompt token; parents before children.
PARENTS = {"a": [-1, 0, 1, 2, 3], "b": [-1, 0, 0, 1, 3]}
ACCEPT = {"a": 3, "b": 4}  # accepted node: its root path is kept


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def model(request, tiny_checkpoint):
    return load_model(tiny_checkpoint(request.param, 13))


def _path(parents, j):
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def test_verify_then_commit_matches_plain_scoring(model):
    h = PagedHarness(model, page_size=PAGE, num_pages=48, num_slots=6, pages_per_seq=8, seed=1)
    # Prefill all but the last prompt token (the last one is node 0 of the verify step).
    h.step({k: v[:-1] for k, v in PROMPTS.items()}, num_tokens=16, batch_size=4)
    rng = np.random.default_rng(0)
    n = 5
    drafts = {k: [v[-1]] + [int(t) for t in rng.integers(0, tm.VOCAB, n - 1)] for k, v in PROMPTS.items()}
    order = ["a", "b", None]  # a padding row too
    for k in PROMPTS:
        h._ensure_pages(k, h.length[k] + n)
    table = np.zeros((3, h.pages_per_seq), np.int32)
    for i, k in enumerate(order[:2]):
        table[i, :len(h.pages[k])] = h.pages[k]
    parents = jnp.asarray([PARENTS["a"], PARENTS["b"], [-1, 0, 1, 2, 3]], jnp.int32)
    depth = np.zeros((3, n), np.int32)
    for i, k in enumerate(order[:2]):
        depth[i] = [len(_path(PARENTS[k], j)) - 1 for j in range(n)]
    tokens = jnp.asarray([drafts["a"], drafts["b"], [0] * n], jnp.int32)
    l0 = jnp.asarray([h.length["a"], h.length["b"], 0], jnp.int32)
    valid = jnp.asarray([True, True, False])
    slots = jnp.asarray([h.slot["a"], h.slot["b"], 0], jnp.int32)
    page_table = jnp.asarray(table)
    batch = verify.verify_batch(tokens, l0, valid, page_table, slots, PAGE, depth=jnp.asarray(depth),
                                parents=parents, tree_mask=tree.ancestor_mask(parents))
    out, caches = forward(model, h.caches, batch)
    logits = np.asarray(out.logits).reshape(3, n, -1)
    for i, k in enumerate(order[:2]):
        for j in range(n):
            seq = PROMPTS[k][:-1] + [drafts[k][m] for m in _path(PARENTS[k], j)]
            ref = model.score(seq)[-1]
            np.testing.assert_allclose(logits[i, j], ref, rtol=2e-4, atol=2e-4, err_msg=f"{k} node {j}")

    # Accept: move the kept path's KV into place, commit the GDN state of the accepted node.
    path = np.zeros((3, n), np.int32)
    acc_n = np.zeros(3, np.int32)
    for i, k in enumerate(order[:2]):
        p = _path(PARENTS[k], ACCEPT[k])
        path[i, :len(p)] = p
        path[i, len(p):] = p[-1]
        acc_n[i] = len(p) - 1
    caches = move_kv(caches, page_table, l0, jnp.asarray(path), jnp.asarray(acc_n), valid, PAGE)
    accepted = jnp.asarray([ACCEPT["a"], ACCEPT["b"], -1], jnp.int32)
    h.caches = verify.commit(caches, out.gdn_scratch, slots, accepted, parents)
    for i, k in enumerate(order[:2]):
        h.length[k] += int(acc_n[i]) + 1
    nxt = {k: [int(t)] for k, t in zip(PROMPTS, rng.integers(0, tm.VOCAB, 2))}
    got = h.step(nxt, num_tokens=2, batch_size=2, mode=ForwardMode.DECODE)
    for i, k in enumerate(order[:2]):
        seq = PROMPTS[k][:-1] + [drafts[k][m] for m in _path(PARENTS[k], ACCEPT[k])] + nxt[k]
        np.testing.assert_allclose(got[k][0], model.score(seq)[-1], rtol=2e-4, atol=2e-4, err_msg=k)


def test_tree_select_is_closed_and_parent_first():
    """The N - 1 best candidates always include each one's parent, listed before it."""
    rng = np.random.default_rng(0)
    k, s, n = 3, 4, 9
    depth = np.concatenate([np.ones(k, np.int32)] + [np.full(k * k, d, np.int32) for d in range(2, s + 1)])
    for _ in range(20):
        b = 4
        scores, parents = [], []
        lvl = np.sort(rng.uniform(-3, 0, (b, k)))[:, ::-1]
        scores.append(lvl)
        parents.append(np.full((b, k), -1))
        kept_pool, kept_score = np.tile(np.arange(k), (b, 1)), lvl
        base = k
        for _ in range(2, s + 1):
            child = kept_score[:, :, None] + rng.uniform(-3, 0, (b, k, k))
            scores.append(child.reshape(b, -1))
            parents.append(np.repeat(kept_pool, k, axis=1))
            best = np.argsort(-child.reshape(b, -1), axis=1, kind="stable")[:, :k]
            kept_pool = base + best
            kept_score = np.take_along_axis(child.reshape(b, -1), best, axis=1)
            base += k * k
        toks = jnp.asarray(rng.integers(0, 50, (b, base)), jnp.int32)
        d, dep, par = tree.select(toks, jnp.asarray(np.concatenate(scores, 1), jnp.float32),
                                  jnp.asarray(np.concatenate(parents, 1), jnp.int32), depth, n)
        par, dep = np.asarray(par), np.asarray(dep)
        assert (par[:, 0] == -1).all()
        for r in range(b):
            for j in range(1, n):
                assert 0 <= par[r, j] < j
                assert dep[r, j] == dep[r, par[r, j]] + 1
