"""Structured output inside a speculative step: what the host decided about each row's drafts.

A grammar-constrained row cannot verify a draft node whose path the grammar forbids, and needs the
grammar's mask at every node it may accept. The step therefore runs in two parts
(`step_common.compose`): after the draft phase the host reads the drafts, walks each constrained
row's grammar along them (`jspec.runtime.grammar.draft_inputs`) and sends back, per row:

- `replaced` `[B]`: the row verifies the grammar's forced run (tokens it admits alone, accepted with
  certainty) instead of its drafts: `tokens` `[B, D]` hold that run. A chain takes it as its drafts;
  a tree as the chain of nodes 1..k, each the child of the one before, its other nodes hung off
  the root (still verified, never walked);
- `walk` `[B, N]`: 1 for the nodes whose path the grammar allows (the root too), 2 for forbidden
  drafts right below those (the masked target rejects them with certainty, so acceptance may try
  them; a simulated acceptance, which keeps drafts blindly, stops before them), 0 for the rest; a
  chain tries at most its leading run of tryable nodes, a tree walks only those;
- masks `[B, N, W]`: the grammar's allowed tokens at every node, applied to the target's logits.

Unconstrained rows have replaced 0, every node walkable and all-allowed masks: their steps are
exactly the unconstrained ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def override_chain(drafts, q, replaced, tokens):
    """A chain's drafts `[B, S]` (and the drafter's distributions q `[B, S, V]` or None) with the
    replaced rows' forced runs, which are point masses: the host chose them deterministically."""
    drafts = jnp.where(replaced[:, None], tokens, drafts)
    if q is not None:
        q = jnp.where(replaced[:, None, None], jax.nn.one_hot(tokens, q.shape[-1], dtype=q.dtype), q)
    return drafts, q


def override_tree(drafts, parents, depth, replaced, tokens, walk):
    """A tree's drafts `[B, N-1]`, parents and depths `[B, N]` with the replaced rows' forced runs
    laid out as the chain of nodes 1..k (k + 1 = the row's walkable nodes)."""
    node = jnp.arange(parents.shape[1])[None, :]
    chain = node < jnp.sum(walk, axis=1, keepdims=True)
    chain_parents = jnp.where(chain, node - 1, 0).at[:, 0].set(-1)
    chain_depth = jnp.where(chain, node, 1).at[:, 0].set(0)
    on = replaced[:, None]
    return (jnp.where(on, tokens, drafts), jnp.where(on, chain_parents, parents),
            jnp.where(on, chain_depth, depth))


def chain_limit(walk, *, allowed_only: bool = False):
    """`[B]` drafts a chain may try: the tryable nodes after the root (allowed_only: the allowed
    ones, for a simulated acceptance), up to the first that is not."""
    ok = walk[:, 1:] == 1 if allowed_only else walk[:, 1:] > 0
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def path_limit(walk, path):
    """`[B]` steps along a tree path `[B, S + 1]` (root first, repeating at a leaf) through allowed
    nodes only: how far a simulated acceptance may go."""
    moves = (path[:, 1:] != path[:, :-1]) & (jnp.take_along_axis(walk, path, axis=1)[:, 1:] == 1)
    return jnp.sum(jnp.cumprod(moves.astype(jnp.int32), axis=1), axis=1)


def walk_parents(parents, walk):
    """The parents a tree's acceptance walks: a node it may not try has none (-2: no walk finds it)."""
    return jnp.where(walk > 0, parents, -2)
