"""Acceptance of a drafted chain against the target's verify logits, on device.

Greedy rows keep d(j+1) while it equals the target's argmax at j; the argmax after the last kept
token is the bonus. Sampling rows use speculative (rejection) sampling, which keeps the target
distribution exactly: d(j+1) ~ q(j+1) is kept with probability min(1, p(j)[d] / q(j+1)[d]); at
the first rejection the bonus is drawn from normalise(max(p(j) - q(j+1), 0)), after a fully kept
chain from p(S). p and q are the filtered distributions (temperature, top-k, top-p, min-p) of
target and drafter. A drafter that picks its tokens deterministically (NGRAM, and the EAGLE
family, which drafts its top-1) proposes a point mass q = one-hot(d): then d is kept with
probability p(d) and the residual is p without d, renormalised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import ops
from jspec.runtime import sampler as sampling


def _argmax(logits, tp: int):
    """argmax over the last (vocabulary) axis of `[..., V]`, split tp ways (`ops.vocab_argmax`)."""
    return ops.vocab_argmax(logits.reshape(-1, logits.shape[-1]), tp=tp).reshape(logits.shape[:-1]).astype(jnp.int32)


def chain(logits, d, q_all, sb: sampling.SamplingBatch, greedy, key_fn, *, sort, limit=None, tp: int = 1):
    """logits `[B, S+1, V]` (target at nodes 0..S), d `[B, S]` draft tokens, q_all `[B, S, V]` or
    None (point masses). key_fn(k) -> `[B]` keys for the k-th random use (0..S). limit `[B]` or
    None: drafts from index limit on count as never proposed (a grammar-constrained row verifies
    only its forced run), so the bonus at node limit comes from p itself. Returns the number of
    kept drafts n `[B]` in 0..S and the bonus token `[B]`. tp: the vocabulary's split (argmaxes
    and draws reduce across devices with all-reduces)."""
    b, n_nodes, vocab = logits.shape
    s = n_nodes - 1
    if s == 0:  # nothing drafted (a speculative engine's plain step): the bonus is a plain sample
        p = sampling.filtered_probs(logits[:, 0], sb, sort=sort, tp=tp)
        drawn = sampling.categorical(key_fn(0), jnp.log(p), tp=tp).astype(jnp.int32)
        return jnp.zeros((b,), jnp.int32), jnp.where(greedy, _argmax(logits[:, 0], tp), drawn)
    limit = jnp.full((b,), s, jnp.int32) if limit is None else limit
    proposed = jnp.arange(s)[None, :] < limit[:, None]
    a = _argmax(logits, tp)
    n_greedy = jnp.sum(jnp.cumprod(((d == a[:, :s]) & proposed).astype(jnp.int32), axis=1), axis=1)
    bonus_greedy = jnp.take_along_axis(a, n_greedy[:, None], axis=1)[:, 0]

    rep = jax.tree_util.tree_map(lambda f: jnp.repeat(f, n_nodes, axis=0), sb)
    p_all = sampling.filtered_probs(logits.reshape(b * n_nodes, vocab), rep, sort=sort, tp=tp)
    p_all = p_all.reshape(b, n_nodes, vocab)
    p_d = ops.vocab_take(p_all[:, :s], d[:, :, None], tp=tp)[:, :, 0]  # p(j)[d(j+1)]
    q_d = jnp.ones_like(p_d) if q_all is None else jnp.take_along_axis(q_all, d[:, :, None], axis=2)[:, :, 0]
    u = jnp.stack([jax.vmap(lambda kk: jax.random.uniform(kk))(key_fn(j)) for j in range(s)], axis=1)
    keep = (u * q_d < p_d) & proposed  # u < p / q without dividing by a possibly tiny q
    n_sample = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.take_along_axis(p_all, n_sample[:, None, None], axis=1)[:, 0]  # [B, V]
    at = jnp.minimum(n_sample, s - 1)
    if q_all is None:
        q_n = jax.nn.one_hot(jnp.take_along_axis(d, at[:, None], axis=1)[:, 0], vocab)
    else:
        q_n = jnp.take_along_axis(q_all, at[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # After a fully kept chain (or run up to the limit) the bonus comes from p itself; a zero
    # residual (p == q on the support, so rejection had probability 0) falls back to p as well.
    use_p = (n_sample >= limit)[:, None] | (mass <= 0)
    r = jnp.where(use_p, p_n, residual / jnp.where(mass > 0, mass, 1.0))
    bonus_sample = sampling.categorical(key_fn(s), jnp.log(r), tp=tp).astype(jnp.int32)

    n = jnp.where(greedy, n_greedy, n_sample)
    bonus = jnp.where(greedy, bonus_greedy, bonus_sample)
    return n, bonus


def simulated(logits, key_fn, mean_accept: float, s: int, sb, greedy, *, sort, limit=None, tp: int = 1):
    """Benchmark-only acceptance (`speculative_simulate_accept_length`): the number of kept drafts
    is drawn so that its mean plus the bonus equals `mean_accept` (clipped to 1 .. S+1),
    whatever the drafts are (at most `limit` [B] when given: a tree path's length); the bonus is
    the target's own token after them. Not exact."""
    m = min(max(mean_accept, 1.0), s + 1.0) - 1.0
    lo = int(m)
    frac = m - lo
    u = jax.vmap(lambda kk: jax.random.uniform(kk))(key_fn(0))
    n = jnp.minimum(lo + (u < frac).astype(jnp.int32), s if limit is None else limit)
    at = jnp.take_along_axis(logits, n[:, None, None], axis=1)[:, 0]
    p = sampling.filtered_probs(at, sb, sort=sort, tp=tp)
    drawn = sampling.categorical(key_fn(s), jnp.log(p), tp=tp).astype(jnp.int32)
    bonus = jnp.where(greedy, _argmax(at, tp), drawn)
    return n, bonus


def output_rows(d, n, bonus, valid):
    """`[B, S+2]` int32 rows: [count = n + 1, kept drafts, bonus, -1 padding] (count 0 on padding)."""
    b, s = d.shape
    j = jnp.arange(s + 1)[None, :]
    d_pad = jnp.concatenate([d, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], d_pad, jnp.where(j == n[:, None], bonus[:, None], -1))
    count = jnp.where(valid, n + 1, 0)
    return jnp.concatenate([count[:, None], tokens], axis=1).astype(jnp.int32)
