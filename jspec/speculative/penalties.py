"""Sampling penalties and reported logprobs at the nodes of a speculative step.

A draft node's distribution is the one the plain sampler would use had the drafts before it been
accepted: its penalties count the request's outputs so far (`output_counts`, which already hold
the root, the previous step's bonus) plus the draft tokens on its own path (its ancestors and
itself, the root excluded). So the counts change along a chain and differ between tree branches.

`penalise_nodes` applies the slot's penalties to every node at once (one broadcast over `[B, N, V]`,
as `sampler.apply_penalties` does per row), then rewrites the few entries whose counts the path
changes: at most N - 1 tokens per node, each recomputed from its raw logit with the count it has
there. Entries of one token at one node are written with the same value however often the token
occurs, so the scatter has no conflicting writes.

`path_logprobs` reports, for the tokens a step emits, what the plain sampler reports for a token:
log_softmax(penalised logits / T) (T = 1 for greedy rows) at the node each token was drawn from,
and the top-k of that distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import ops
from jspec.runtime import sampler as sampling


def penalise_nodes(logits, sb: sampling.SamplingBatch, counts, prompt_mask, tokens, ancestors, *, tp: int = 1):
    """logits `[B, N, V]` (float32), counts `[B, V]` / prompt_mask `[B, V]` (the rows' slots),
    tokens `[B, N]` (node 0 the root), ancestors `[B, N, N]` (row j: j and its ancestors); tp: the
    vocabulary's split (the few entries are read and written where they live, `ops.vocab_take` /
    `ops.vocab_put`). Returns the penalised logits `[B, N, V]`."""
    b, n, _ = logits.shape
    base = jax.vmap(lambda x: sampling.apply_penalties(x, sb, counts, prompt_mask), in_axes=1, out_axes=1)(logits)
    if n == 1:
        return base
    tok = jnp.broadcast_to(tokens[:, None, 1:], (b, n, n - 1))  # candidate tokens at every node
    on = ancestors[:, :, 1:]  # [B, N, N-1]: draft i is on node j's path
    # m[b, j, i]: how often draft i's token occurs on node j's path (0: it does not, whatever i is).
    same = tokens[:, 1:, None] == tokens[:, None, 1:]  # [B, N-1, N-1]
    m = jnp.sum(same[:, None, :, :] & on[:, :, None, :], axis=-1)
    raw = ops.vocab_take(logits, tok, tp=tp)
    count = ops.vocab_take(counts, tok.reshape(b, n * (n - 1)), tp=tp).reshape(b, n, n - 1) + m
    rep = sb.repetition_penalty[:, None, None]
    val = jnp.where(raw > 0, raw / rep, raw * rep)  # the token is in the output now: repetition applies
    val = val - sb.frequency_penalty[:, None, None] * count.astype(val.dtype) - sb.presence_penalty[:, None, None]
    new = jnp.where(m > 0, val, ops.vocab_take(base, tok, tp=tp))
    return ops.vocab_put(base, tok, new, tp=tp)


def chain_ancestors(batch: int, n: int):
    """`[B, N, N]` ancestors of a chain: node j's path is nodes 0..j."""
    tri = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    return jnp.broadcast_to(tri[None], (batch, n, n))


def path_logprobs(path_logits, emitted, sb: sampling.SamplingBatch, num_top: int, *, vocab_shards: int = 1):
    """path_logits `[B, M, V]` (penalised; entry j the node that drew emitted[:, j]), emitted `[B, M]`.
    Returns logprobs `[B, M]`, top ids `[B, M, num_top]` int32 and top logprobs `[B, M, num_top]`."""
    b, m, v = path_logits.shape
    rep = jax.tree_util.tree_map(lambda f: jnp.repeat(f, m, axis=0), sb)
    lp = sampling.processed_logprobs(path_logits.reshape(b * m, v), rep)
    chosen = ops.vocab_take(lp, jnp.clip(emitted.reshape(-1, 1), 0, v - 1), tp=vocab_shards).reshape(b, m)
    if num_top > 0:
        top_lp, top_ids = ops.vocab_top_k(lp, num_top, tp=vocab_shards, rows=sampling.wants_top_logprobs(rep))
    else:
        top_lp, top_ids = jnp.zeros((b * m, 0), jnp.float32), jnp.zeros((b * m, 0), jnp.int32)
    return chosen, top_ids.astype(jnp.int32).reshape(b, m, num_top), top_lp.reshape(b, m, num_top)
