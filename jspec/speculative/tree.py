"""Draft trees on device: EAGLE's top-k expansion, ancestor masks, and tree acceptance.

Expansion (`speculative_eagle_topk` = K > 1, S = num_steps, N = num_draft_tokens): depth 1 holds
the K proposals carried from the last step; each later depth expands the K kept nodes of the
previous one into their K best children each, scores paths by cumulative log-probability, and
keeps the K best of those K * K for the next expansion. Every candidate of every depth goes into a
pool in depth order, and the verified tree is the root (the request's last token) plus the N - 1
best-scoring candidates in pool order. A child never scores above its parent (log-probabilities are
<= 0) and comes later in the pool, so the chosen set always contains each node's parent and lists
parents before children: the order the verify kernels and the mask need.

Acceptance walks the tree from the root. Greedy: move to the child whose token is the target's
argmax, while one exists. Sampling: the drafts are deterministic (top-k), i.e. point masses, so
the children of the current node are tried in order, child t accepted with probability
p(t) / (1 - p(rejected siblings)); after a rejection of every child, the bonus is drawn from p with
the rejected tokens removed; after an accepted leaf, from the leaf's p. This is exact: the accepted
token is distributed as p (Chen et al.'s rejection step with a point-mass draft, applied in turn).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import ops
from jspec.runtime import sampler as sampling


def ancestor_mask(parents):
    """parents `[B, N]` (tree index, -1 for roots; parents before children) -> `[B, N, N]` bool,
    row j true at j and at each of its ancestors."""
    b, n = parents.shape
    rows = []
    for j in range(n):
        own = jnp.zeros((b, n), bool).at[:, j].set(True)
        if j > 0:
            p = parents[:, j]
            earlier = jnp.stack(rows, axis=1)  # [B, j, N]
            from_parent = jnp.take_along_axis(earlier, jnp.clip(p, 0, j - 1)[:, None, None], axis=1)[:, 0]
            own = own | (from_parent & (p >= 0)[:, None])
        rows.append(own)
    return jnp.stack(rows, axis=1)


def select(pool_tokens, pool_scores, pool_parents, pool_depth, num_nodes: int):
    """The verified tree from the candidate pool `[B, P]` (pool_parents: pool index, -1 = root;
    pool_depth static `[P]`). Returns draft tokens `[B, N-1]`, depth `[B, N]`, tree parents `[B, N]`
    (root first, -1), all in pool order."""
    b, pool = pool_tokens.shape
    _, idx = jax.lax.top_k(pool_scores, num_nodes - 1)  # ties keep the lower (earlier) index
    idx = jnp.sort(idx, axis=1)  # pool order: parents before children
    tokens = jnp.take_along_axis(pool_tokens, idx, axis=1)
    depth = jnp.asarray(pool_depth, jnp.int32)[idx]
    tree_of_pool = jnp.full((b, pool), -1, jnp.int32).at[jnp.arange(b)[:, None], idx].set(
        jnp.arange(1, num_nodes, dtype=jnp.int32)[None, :])
    par_pool = jnp.take_along_axis(pool_parents, idx, axis=1)
    par = jnp.where(par_pool < 0, 0, jnp.take_along_axis(tree_of_pool, jnp.maximum(par_pool, 0), axis=1))
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depth], axis=1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), par], axis=1)
    return tokens, depth, parents


def walk(logits, tokens, parents, sb: sampling.SamplingBatch, greedy, key_fn, max_depth: int, *, sort, tp: int = 1):
    """Accept along the tree. logits `[B, N, V]` (target at every node), tokens `[B, N]` (node 0 is
    the root), parents `[B, N]`. Returns path `[B, max_depth + 1]` (node indices, root first,
    valid up to n), n `[B]` kept drafts, bonus `[B]`. tp: the vocabulary's split."""
    b, n_nodes, vocab = logits.shape
    child = (parents[:, None, :] == jnp.arange(n_nodes)[None, :, None])  # [B, parent, node]
    a = ops.vocab_argmax(logits.reshape(b * n_nodes, vocab), tp=tp).reshape(b, n_nodes).astype(jnp.int32)
    rep = jax.tree_util.tree_map(lambda f: jnp.repeat(f, n_nodes, axis=0), sb)
    p_all = sampling.filtered_probs(logits.reshape(b * n_nodes, vocab), rep, sort=sort, tp=tp)
    p_all = p_all.reshape(b, n_nodes, vocab)
    rows = jnp.arange(b)

    cur = jnp.zeros((b,), jnp.int32)
    live = jnp.ones((b,), bool)  # still walking
    n = jnp.zeros((b,), jnp.int32)
    path = [cur]
    removed = jnp.zeros((b, n_nodes), bool)  # siblings rejected at the node where sampling stopped
    for depth in range(max_depth):
        kids = child[rows, cur] & live[:, None]  # [B, N]
        # Greedy: the child carrying the target's argmax.
        g_match = kids & (tokens == a[rows, cur][:, None])
        g_next = jnp.argmax(g_match, axis=1).astype(jnp.int32)
        g_ok = jnp.any(g_match, axis=1)
        # Sampling: try the children in order against the residual of the current node.
        p_cur = p_all[rows, cur]  # [B, V]
        p_tok = ops.vocab_take(p_cur, tokens, tp=tp)  # [B, N]: p(child token) at this node
        chosen = jnp.full((b,), -1, jnp.int32)
        rm = jnp.zeros((b,), jnp.float32)
        rej = jnp.zeros((b, n_nodes), bool)
        u = jax.vmap(lambda k: jax.random.uniform(k, (n_nodes,)))(key_fn(depth))
        for j in range(1, n_nodes):
            cand = kids[:, j] & (chosen < 0)
            ok = cand & (u[:, j] * (1.0 - rm) < p_tok[:, j])
            chosen = jnp.where(ok, j, chosen)
            rm = jnp.where(cand & ~ok, rm + p_tok[:, j], rm)
            rej = rej.at[:, j].set(cand & ~ok)
        s_ok = chosen >= 0
        step_ok = jnp.where(greedy, g_ok, s_ok)
        nxt = jnp.where(greedy, g_next, jnp.maximum(chosen, 0))
        # Rows that stop here keep this node's rejected siblings for the residual.
        removed = jnp.where((live & ~step_ok)[:, None], rej, removed)
        advance = live & step_ok
        cur = jnp.where(advance, nxt, cur)
        n = n + advance.astype(jnp.int32)
        live = advance
        path.append(cur)
    path = jnp.stack(path, axis=1)

    # Bonus at the last accepted node.
    bonus_greedy = a[rows, cur]
    p_end = p_all[rows, cur]
    drop = jnp.zeros((b, vocab), jnp.int32).at[rows[:, None], tokens].max(removed.astype(jnp.int32)) > 0
    r = jnp.where(drop, 0.0, p_end)
    mass = jnp.sum(r, axis=-1, keepdims=True)
    r = jnp.where(mass > 0, r / jnp.where(mass > 0, mass, 1.0), p_end)
    bonus_sample = sampling.categorical(key_fn(max_depth), jnp.log(r), tp=tp).astype(jnp.int32)
    bonus = jnp.where(greedy, bonus_greedy, bonus_sample)
    return path, n, bonus
