"""The penalised distribution at every node of a speculative step (`penalties.penalise_nodes`)
equals the plain sampler's penalised logits (`sampler.apply_penalties`) with the request's counts
plus the draft tokens on that node's own path: chains and trees, repeated tokens on a path, tokens
that sit on one branch and not another, prompt tokens (repetition penalty). Since acceptance is
exact for whatever target distribution it is given (tests/jspec/speculative/test_tree_accept.py
and the chain tests sample it), speculative sampling with penalties keeps the penalised
distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.runtime import sampler as sampling
from jspec.speculative import penalties, tree

B, N, V = 3, 6, 11


def _batch(rep, freq, pres):
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return sampling.SamplingBatch(temperature=f([0.0] * B), top_p=f([1.0] * B), top_k=jnp.full((B,), -1, jnp.int32),
                                  min_p=f([0.0] * B), repetition_penalty=f(rep), frequency_penalty=f(freq),
                                  presence_penalty=f(pres), seed=jnp.zeros((B,), jnp.int32),
                                  step=jnp.zeros((B,), jnp.int32))


def _reference(logits, sb, counts, prompt, tokens, anc):
    out = np.zeros_like(logits)
    for b in range(B):
        for j in range(N):
            c = counts[b].copy()
            for i in range(1, N):
                if anc[b, j, i]:
                    c[tokens[b, i]] += 1
            one = jax.tree_util.tree_map(lambda f: f[b:b + 1], sb)  # row b (None fields stay None)
            out[b, j] = np.asarray(sampling.apply_penalties(jnp.asarray(logits[b:b + 1, j]), one,
                                                            jnp.asarray(c[None]), jnp.asarray(prompt[b:b + 1])))[0]
    return out


def test_penalised_nodes_equal_the_plain_sampler_along_each_path():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((B, N, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (B, V)).astype(np.int32)
    prompt = rng.random((B, V)) < 0.3
    # Row 0 a chain with a repeated token; rows 1-2 trees whose branches share and repeat tokens.
    tokens = np.array([[5, 2, 2, 7, 2, 9], [1, 4, 4, 3, 4, 3], [0, 6, 8, 6, 6, 8]], np.int32)
    parents = np.array([[-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 2, 3], [-1, 0, 0, 1, 1, 2]], np.int32)
    anc = np.asarray(tree.ancestor_mask(jnp.asarray(parents)))
    sb = _batch([1.5, 1.0, 0.7], [0.5, 1.2, -0.3], [0.25, 0.0, 0.8])
    got = penalties.penalise_nodes(jnp.asarray(logits), sb, jnp.asarray(counts), jnp.asarray(prompt),
                                   jnp.asarray(tokens), jnp.asarray(anc))
    np.testing.assert_allclose(np.asarray(got), _reference(logits, sb, counts, prompt, tokens, anc), rtol=1e-6,
                               atol=1e-6)
    # The chain helper gives a chain's ancestors.
    np.testing.assert_array_equal(np.asarray(penalties.chain_ancestors(B, N))[0], anc[0])


def test_path_logprobs_are_the_plain_samplers_reported_logprobs():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((B, 4, V)).astype(np.float32))
    emitted = jnp.asarray(rng.integers(0, V, (B, 4)).astype(np.int32))
    sb = _batch([1.0] * B, [0.0] * B, [0.0] * B)
    sb.temperature = jnp.asarray([0.0, 0.7, 1.3], jnp.float32)
    lp, top_ids, top_lp = penalties.path_logprobs(logits, emitted, sb, 3)
    for b in range(B):
        t = float(sb.temperature[b]) or 1.0  # greedy rows report T = 1
        want = np.asarray(jnp.log(jnp.exp(logits[b] / t) / jnp.sum(jnp.exp(logits[b] / t), -1, keepdims=True)))
        np.testing.assert_allclose(np.asarray(lp[b]), want[np.arange(4), np.asarray(emitted[b])], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(top_ids[b]), np.argsort(-want, axis=-1, kind="stable")[:, :3])
        np.testing.assert_allclose(np.asarray(top_lp[b]), -np.sort(-want, axis=-1)[:, :3], rtol=1e-5, atol=1e-6)
