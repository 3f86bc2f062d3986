"""Device sampler against a numpy reference: penalties, logit bias, top-k / top-p / min-p, ties,
greedy rows, sampling frequencies, seeded reproducibility across batches, static shapes, the no-sort
fast path, and the sampling fields' way from the host (packed) to the device.

Compilation dominates CPU time here, so almost every call uses one shape, [B, V] = [8, 64], and
one top-logprob count, and hits the same compiled functions.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.runtime.sampler import (
    SamplingBatch,
    add_prompt_tokens,
    apply_penalties,
    filtered_probs,
    reset_slots,
    sample,
    update_counts,
)
from jspec.models.batch import ForwardMode
from jspec.runtime.request import Request
from jspec.runtime.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jspec.runtime.scheduler import ScheduledReq, StepPlan
from jspec.runtime.step_inputs import Bucket, pack, sampling_batch

B, V, K = 8, 64, 4
KB = 6  # logit-bias entries a row in these tests
DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                frequency_penalty=0.0, presence_penalty=0.0, seed=0, step=0, top_logprobs_num=K)
PENALTY_KEYS = ("repetition_penalty", "frequency_penalty", "presence_penalty")

TRACES = []


def _counted_sample(*args, **kwargs):
    TRACES.append(1)  # runs only while tracing: counts compilations
    return sample(*args, **kwargs)


sample_jit = jax.jit(_counted_sample, static_argnames="num_top_logprobs")
filtered_probs_jit = jax.jit(filtered_probs)
apply_penalties_jit = jax.jit(apply_penalties)


def make_batch(rows: list[dict]) -> SamplingBatch:
    """Raw device rows (not normalised, so top_k = 1 with T > 0 reaches the device as is). A row's
    `logit_bias` ({token: bias}) fills the batch's bias columns, KB entries a row (-1: none)."""
    rows = [dict(DEFAULTS, **r) for r in rows]
    dtypes = dict(top_k=np.int32, seed=np.uint32, step=np.int32, top_logprobs_num=np.int32)

    def column(name):
        return jnp.asarray(np.array([r[name] for r in rows], dtypes.get(name, np.float32)))

    bias = {}
    if any("logit_bias" in r for r in rows):
        ids, values = np.full((len(rows), KB), -1, np.int32), np.zeros((len(rows), KB), np.float32)
        for i, r in enumerate(rows):
            for k, (tok, b) in enumerate(r.get("logit_bias", {}).items()):
                ids[i, k], values[i, k] = tok, b
        bias = dict(logit_bias_ids=jnp.asarray(ids), logit_bias_values=jnp.asarray(values))
    return SamplingBatch(**{name: column(name) for name in DEFAULTS}, **bias)


def random_inputs(rng, batch=B, vocab=V, scale=2.0):
    logits = rng.normal(0.0, scale, (batch, vocab)).astype(np.float32)
    counts = (rng.integers(1, 4, (batch, vocab)) * (rng.random((batch, vocab)) < 0.3)).astype(np.int32)
    prompt_mask = rng.random((batch, vocab)) < 0.2
    return logits, counts, prompt_mask


# ----------------------------------------------------------------------------- numpy reference


def ref_penalties(logits, row, counts, prompt_mask):
    """The penalties, then the row's logit bias (added after them, as SGLang does)."""
    x = logits.astype(np.float64)
    rep = row["repetition_penalty"]
    seen = prompt_mask | (counts > 0)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - row["frequency_penalty"] * counts - row["presence_penalty"] * (counts > 0)
    for tok, b in row.get("logit_bias", {}).items():
        x[tok] += b
    return x


def ref_logprobs(x, row):
    t = row["temperature"] if row["temperature"] >= 1e-5 else 1.0
    z = x / t
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def ref_filtered_probs(x, row):
    """Written from the rules, one token at a time, in rank order (-p, id)."""
    vocab = len(x)
    if row["temperature"] < 1e-5:
        return np.eye(vocab)[int(np.argmax(x))]
    p = np.exp(ref_logprobs(x, row))
    order = sorted(range(vocab), key=lambda i: (-p[i], i))
    keep = np.zeros(vocab, bool)
    mass_before = 0.0
    for rank, i in enumerate(order):
        in_top_k = row["top_k"] == -1 or rank < row["top_k"]
        in_top_p = row["top_p"] >= 1.0 or mass_before < row["top_p"]
        keep[i] = in_top_k and in_top_p
        mass_before += p[i]
    keep &= p >= row["min_p"] * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def check_against_reference(logits, rows, counts, prompt_mask) -> float:
    """Max |device - reference| over all rows, fed through the device in batches of B rows."""
    worst = 0.0
    for lo in range(0, len(rows), B):
        chunk = [dict(DEFAULTS, **r) for r in rows[lo:lo + B]]
        chunk += [dict(DEFAULTS)] * (B - len(chunk))  # pad the last batch like the engine would
        idx = [min(i, len(rows) - 1) for i in range(lo, lo + B)]
        batch = make_batch(chunk)
        penalised = apply_penalties_jit(jnp.asarray(logits[idx]), batch, jnp.asarray(counts[idx]),
                                        jnp.asarray(prompt_mask[idx]))
        probs = np.asarray(filtered_probs_jit(penalised, batch))
        for r in range(min(B, len(rows) - lo)):
            i, row = idx[r], chunk[r]
            x = ref_penalties(logits[i], row, counts[i], prompt_mask[i])
            np.testing.assert_allclose(np.asarray(penalised[r]), x, rtol=1e-6, atol=1e-6)
            expected = ref_filtered_probs(x, row)
            assert np.array_equal(probs[r] > 0, expected > 0), (row, probs[r], expected)
            worst = max(worst, float(np.abs(probs[r] - expected).max()))
    assert worst <= 1e-6, worst
    return worst


def grid(temperatures, top_ps, top_ks, min_ps, penalties):
    return [
        dict(temperature=t, top_p=tp, top_k=k, min_p=mp, **dict(zip(PENALTY_KEYS, pen)))
        for t, tp, k, mp, pen in itertools.product(temperatures, top_ps, top_ks, min_ps, penalties)
    ]


# ----------------------------------------------------------------------------- tests


def test_filtered_probs_match_reference_on_random_logits():
    penalties = [(1.0, 0.0, 0.0), (1.3, 0.5, -0.4), (0.8, -1.0, 1.5)]
    rows = grid([0.0, 0.5, 1.0, 1.7], [1.0, 0.95, 0.5, 0.1], [-1, 1, 5, V, V + 10], [0.0, 0.05, 0.5], penalties)
    logits, counts, prompt_mask = random_inputs(np.random.default_rng(0), batch=len(rows))
    check_against_reference(logits, rows, counts, prompt_mask)


def test_filtered_probs_match_reference_with_ties():
    # Logits on a quarter grid and penalties / temperatures that scale exactly: many exact ties,
    # identical in float32 and float64, so the id tie-break is what decides top-k / top-p cuts.
    penalties = [(1.0, 0.0, 0.0), (2.0, 0.5, 0.25), (0.5, -0.25, -1.0)]
    rows = grid([0.0, 0.5, 1.0, 2.0], [1.0, 0.9, 0.5, 0.2], [-1, 1, 3, 7, V - 1], [0.0, 0.5], penalties)
    rng = np.random.default_rng(1)
    _, counts, prompt_mask = random_inputs(rng, batch=len(rows))
    logits = (rng.integers(-8, 8, (len(rows), V)) * 0.25).astype(np.float32)
    check_against_reference(logits, rows, counts, prompt_mask)


def test_ties_rank_the_lower_id_first():
    # -inf pads each row to V: masked tokens, as a grammar mask would produce.
    heads = [[1.0, 3.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, -9.0], [2.0, 5.0, 5.0, 1.0, 5.0],
             [0.0, 0.0, 0.0, 0.0, -np.inf], [1.0, 3.0, 3.0, 0.0, 3.0]]
    logits = np.full((B, V), -np.inf, np.float32)
    logits[:5, :5] = heads
    logits[5:, :5] = 0.0
    rows = [dict(top_k=2), dict(top_p=0.4), dict(temperature=0.0), dict(top_p=0.5), dict(min_p=1.0)]
    rows += [dict(temperature=0.0)] * (B - len(rows))
    probs = np.asarray(filtered_probs_jit(jnp.asarray(logits), make_batch(rows)))
    assert np.all(probs[:, 5:] == 0)
    np.testing.assert_allclose(probs[0, :5], [0, 0.5, 0.5, 0, 0], atol=1e-7)
    # Four tokens of mass ~0.25 each: the prefix reaching 0.4 is the two lowest ids.
    np.testing.assert_allclose(probs[1, :5], [0.5, 0.5, 0, 0, 0], atol=1e-7)
    np.testing.assert_array_equal(probs[2, :5], [0, 1, 0, 0, 0])
    # Exactly 0.25 each (a power of two survives exp(log_softmax) on CPU): the mass before id 2 is
    # exactly 0.5, which is not < top_p = 0.5, so the boundary token is dropped.
    assert float(jnp.exp(jax.nn.log_softmax(jnp.asarray(logits[3])))[0]) == 0.25
    np.testing.assert_array_equal(probs[3, :5], [0.5, 0.5, 0, 0, 0])
    # min_p = 1 keeps exactly the tied maxima (p >= min_p * max p, not >).
    np.testing.assert_allclose(probs[4, :5], [0, 1 / 3, 1 / 3, 0, 1 / 3], atol=1e-7)
    zeros = jnp.zeros((B, V), jnp.int32)
    out = sample_jit(jnp.asarray(logits), make_batch(rows), zeros, zeros > 0, num_top_logprobs=K)
    assert int(out.tokens[2]) == 1 and int(out.tokens[5]) == 0
    np.testing.assert_array_equal(np.asarray(out.top_ids[:3]), [[1, 2, 3, 0], [0, 1, 2, 3], [1, 2, 4, 0]])


def test_greedy_rows_pick_the_argmax():
    logits, counts, prompt_mask = random_inputs(np.random.default_rng(2))
    logits[0, [7, 9]] = logits[0].max() + 1.0  # a tie at the top: the lower id wins
    # Greedy whatever the other knobs say, and whatever the seed / step.
    rows = [dict(temperature=0.0, seed=s, step=3 * s, top_p=0.5, min_p=0.3) for s in range(B)]
    zeros = jnp.zeros((B, V), jnp.int32)
    out = sample_jit(jnp.asarray(logits), make_batch(rows), zeros, zeros > 0, num_top_logprobs=K)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    assert int(out.tokens[0]) == 7
    assert out.tokens.dtype == jnp.int32 and out.top_ids.dtype == jnp.int32


def test_logprobs_are_the_processed_distribution_before_filtering():
    rows = [dict(temperature=0.7, top_k=3, min_p=0.2, repetition_penalty=1.2, frequency_penalty=0.3, seed=5),
            dict(temperature=0.0, presence_penalty=1.0, top_p=0.3),
            dict(temperature=1.5, top_p=0.8, seed=9, step=4),
            dict(temperature=0.3, seed=1, step=1, repetition_penalty=0.7, presence_penalty=-0.5)] * 2
    logits, counts, prompt_mask = random_inputs(np.random.default_rng(3))
    out = sample_jit(jnp.asarray(logits), make_batch(rows), jnp.asarray(counts), jnp.asarray(prompt_mask),
                     num_top_logprobs=K)
    for r, row in enumerate(rows):
        row = dict(DEFAULTS, **row)
        lp = ref_logprobs(ref_penalties(logits[r], row, counts[r], prompt_mask[r]), row)
        token = int(out.tokens[r])
        np.testing.assert_allclose(float(out.logprobs[r]), lp[token], atol=1e-5)
        top = np.argsort(-lp, kind="stable")[:K]
        np.testing.assert_array_equal(np.asarray(out.top_ids[r]), top)
        np.testing.assert_allclose(np.asarray(out.top_logprobs[r]), lp[top], atol=1e-5)


def test_logit_bias_is_added_after_the_penalties():
    """Each row's own bias at its own tokens, on the penalised logits: the tokens, logprobs and top
    logprobs follow the reference; a -100 bias makes a token impossible, also for greedy rows."""
    logits, counts, prompt_mask = random_inputs(np.random.default_rng(6))
    rows = [dict(temperature=0.0, logit_bias={int(np.argmax(logits[0])): -100.0}),  # the argmax banned
            dict(temperature=0.0, repetition_penalty=1.3, logit_bias={3: 4.0, 7: -2.0}),
            dict(temperature=0.8, seed=4, frequency_penalty=0.4, logit_bias={i: 0.5 * i for i in range(KB)}),
            dict(temperature=0.0)] * 2  # no bias beside biased rows
    out = sample_jit(jnp.asarray(logits), make_batch(rows), jnp.asarray(counts), jnp.asarray(prompt_mask),
                     num_top_logprobs=K)
    assert int(out.tokens[0]) != int(np.argmax(logits[0]))
    for r, row in enumerate(rows):
        row = dict(DEFAULTS, **row)
        x = ref_penalties(logits[r], row, counts[r], prompt_mask[r])
        lp = ref_logprobs(x, row)
        if row["temperature"] == 0.0:
            assert int(out.tokens[r]) == int(np.argmax(x))
        np.testing.assert_allclose(float(out.logprobs[r]), lp[int(out.tokens[r])], atol=1e-5)
        top = np.argsort(-lp, kind="stable")[:K]
        np.testing.assert_array_equal(np.asarray(out.top_ids[r]), top)
        np.testing.assert_allclose(np.asarray(out.top_logprobs[r]), lp[top], atol=1e-5)


def test_top_logprobs_only_for_rows_that_return_them():
    """Rows whose request asks for no top logprobs get zeros there (the top-k skips them); the
    other rows, the tokens and their logprobs are those of a batch where every row asks."""
    rows = [dict(temperature=0.7, seed=5), dict(temperature=0.0), dict(temperature=1.5, seed=9, step=4),
            dict(temperature=0.3, seed=1, step=1)] * 2
    logits, counts, prompt_mask = (jnp.asarray(a) for a in random_inputs(np.random.default_rng(4)))
    every = sample_jit(logits, make_batch(rows), counts, prompt_mask, num_top_logprobs=K)
    asks = np.array([1, 0, 0, 1, 0, 1, 1, 0]) * K
    some = sample_jit(logits, make_batch([dict(r, top_logprobs_num=n) for r, n in zip(rows, asks)]), counts,
                      prompt_mask, num_top_logprobs=K)
    np.testing.assert_array_equal(np.asarray(some.tokens), np.asarray(every.tokens))
    np.testing.assert_array_equal(np.asarray(some.logprobs), np.asarray(every.logprobs))
    on = asks > 0
    for got, full in ((some.top_ids, every.top_ids), (some.top_logprobs, every.top_logprobs)):
        np.testing.assert_array_equal(np.asarray(got)[on], np.asarray(full)[on])
        assert not np.asarray(got)[~on].any()


@jax.jit
def draw_many(logits, batch, counts, prompt_mask, steps):
    """One token per step value, for a one-row batch: the row's samples over many steps."""

    def one_draw(step):
        b = dataclasses.replace(batch, step=step[None])
        return sample(logits, b, counts, prompt_mask, num_top_logprobs=0).tokens[0]

    return jax.vmap(one_draw)(steps)


@pytest.mark.parametrize(
    "row",
    [
        dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.5, presence_penalty=0.5, seed=11),
        dict(temperature=0.6, seed=12),  # no top-k / top-p: the no-sort path
        # a logit bias after a repetition penalty: banned tokens never drawn, boosted ones more often
        dict(temperature=0.9, seed=13, repetition_penalty=1.4, logit_bias={0: -100.0, 5: 2.5, 9: 1.0, 17: -1.5}),
    ],
)
def test_sampling_frequencies_follow_filtered_probs(row):
    draws = 20000
    logits, counts, prompt_mask = (jnp.asarray(a) for a in random_inputs(np.random.default_rng(4), batch=1))
    batch = make_batch([row])
    expected = ref_filtered_probs(ref_penalties(np.asarray(logits[0]), dict(DEFAULTS, **row),
                                                np.asarray(counts[0]), np.asarray(prompt_mask[0])),
                                  dict(DEFAULTS, **row))
    tokens = draw_many(logits, batch, counts, prompt_mask, jnp.arange(draws, dtype=jnp.int32))
    freq = np.bincount(np.asarray(tokens), minlength=V) / draws
    assert np.all(freq[expected == 0] == 0), "a filtered-out token was drawn"
    # sigma <= 0.5 / sqrt(20000) = 0.0035 per token: 0.02 is over 5 sigma (and the seed is fixed).
    assert np.abs(freq - expected).max() < 0.02, (freq, expected)
    # Chi-square over tokens with expected count >= 5; 3x the degrees of freedom is far in the tail.
    big = expected * draws >= 5
    chi2 = (((freq[big] - expected[big]) * draws) ** 2 / (expected[big] * draws)).sum()
    assert chi2 < 3 * max(big.sum() - 1, 1), chi2
    assert big.sum() >= 3  # several tokens really are in play


def test_seeded_row_is_independent_of_its_batch():
    steps, at = 12, 3  # `at`: the row's position in the batch of B
    logits, counts, prompt_mask = random_inputs(np.random.default_rng(5), scale=1.0)
    row = dict(temperature=1.0, seed=1234, frequency_penalty=0.2)
    # Neighbours that need the sort path, greedy rows, the same seed with other knobs...
    others = [dict(temperature=0.6, top_k=4, seed=1), dict(temperature=0.0), dict(top_p=0.7, seed=2),
              dict(min_p=0.3, seed=3), dict(temperature=2.0, seed=1234), dict(top_k=1, seed=4),
              dict(repetition_penalty=1.7, seed=5)]
    mixed_rows = others[:at] + [row] + others[at:]

    def draw(rows, idx, step, k):
        return sample_jit(jnp.asarray(logits[idx]), make_batch([dict(r, step=step) for r in rows]),
                          jnp.asarray(counts[idx]), jnp.asarray(prompt_mask[idx]), num_top_logprobs=k)

    alone, mixed = [], []
    for step in range(steps):
        a = draw([row], [at], step, 0)
        m = draw(mixed_rows, list(range(B)), step, K)
        assert a.top_ids.shape == (1, 0) and a.top_logprobs.shape == (1, 0)
        alone.append(int(a.tokens[0]))
        mixed.append(int(m.tokens[at]))
        np.testing.assert_allclose(float(a.logprobs[0]), float(m.logprobs[at]), atol=1e-6)
    assert alone == mixed
    assert len(set(alone)) > 3  # the draws really are random across steps
    other_seed = [int(draw([dict(row, seed=99)], [at], s, 0).tokens[0]) for s in range(steps)]
    assert other_seed != alone


def test_static_shapes_compile_once():
    rng = np.random.default_rng(6)
    sample_jit(*(jnp.asarray(a) for a in random_inputs(rng)[:1]), make_batch([{}] * B),
               *(jnp.asarray(a) for a in random_inputs(rng)[1:]), num_top_logprobs=K)
    before = len(TRACES)
    for rows in ([dict(temperature=0.0)] * B,
                 [dict(top_k=3, seed=1), dict(top_p=0.5), dict(temperature=0.3), dict(min_p=0.1)] * 2,
                 [dict(repetition_penalty=2.0, step=7, seed=2**31 - 1)] * B):
        logits, counts, prompt_mask = random_inputs(rng)
        out = sample_jit(jnp.asarray(logits), make_batch(rows), jnp.asarray(counts), jnp.asarray(prompt_mask),
                         num_top_logprobs=K)
        assert out.tokens.shape == (B,) and out.top_ids.shape == (B, K)
    assert len(TRACES) == before  # new parameter values, same shapes: no new compilation


def test_no_sort_fast_path_matches_the_sort_path():
    plain = [dict(temperature=0.0), dict(temperature=0.9, seed=3), dict(min_p=0.2, seed=4),
             dict(temperature=1.4, top_k=V + 5, seed=5), dict(top_k=V, top_p=1.0, step=2),
             dict(top_k=1, temperature=0.0, seed=6), dict(presence_penalty=1.0, seed=7), dict(seed=8)]
    needs_sort = dict(top_k=3, top_p=0.6, seed=9)
    fast_batch, sort_batch = make_batch(plain), make_batch(plain[:-1] + [needs_sort])
    logits, counts, prompt_mask = (jnp.asarray(a) for a in random_inputs(np.random.default_rng(7)))
    assert "cond" in str(jax.make_jaxpr(filtered_probs)(logits, fast_batch))

    # Same shapes, same executable: only the runtime branch differs for the first B - 1 rows.
    fast, slow = filtered_probs_jit(logits, fast_batch), filtered_probs_jit(logits, sort_batch)
    np.testing.assert_array_equal(np.asarray(fast[:-1]), np.asarray(slow[:-1]))
    fast_out = sample_jit(logits, fast_batch, counts, prompt_mask, num_top_logprobs=K)
    slow_out = sample_jit(logits, sort_batch, counts, prompt_mask, num_top_logprobs=K)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        fast_value, slow_value = np.asarray(getattr(fast_out, name)), np.asarray(getattr(slow_out, name))
        np.testing.assert_array_equal(fast_value[:-1], slow_value[:-1])
    args = [np.asarray(a) for a in (logits, counts, prompt_mask)]
    check_against_reference(args[0], plain, *args[1:])
    check_against_reference(args[0], plain[:-1] + [needs_sort], *args[1:])


def test_packed_sampling_fields_reach_the_device_as_sent():
    """The engine's only way to the device: a plan packed on the host, unpacked and turned into a
    SamplingBatch in the step. Greedy rows go as temperature 0, unseeded requests as their drawn seed."""
    params = [SamplingParams(top_k=5, temperature=0.8, seed=7, min_p=0.1, repetition_penalty=1.3),
              SamplingParams(top_p=0.5, frequency_penalty=0.25, presence_penalty=-0.5), SamplingParams(temperature=0)]
    reqs = []
    for i, sp in enumerate(params):
        r = Request(rid=str(i), input_ids=[3, 4], sampling=sp, seed=sp.seed if sp.seed is not None else 100 + i)
        r.slot = i + 1
        reqs.append(ScheduledReq(r, 2, None, True, False, 3 * i))
    bucket = Bucket(ForwardMode.DECODE, 4, 4, 4)
    b = sampling_batch(bucket.unpack(jnp.asarray(pack(StepPlan(ForwardMode.DECODE, reqs, []), bucket))))
    np.testing.assert_allclose(np.asarray(b.temperature), [0.8, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(b.top_k), [5, -1, -1, -1])
    np.testing.assert_allclose(np.asarray(b.top_p), [1.0, 0.5, 1.0, 1.0])
    np.testing.assert_allclose(np.asarray(b.min_p), [0.1, 0.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(b.repetition_penalty), [1.3, 1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(b.frequency_penalty), [0.0, 0.25, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(b.presence_penalty), [0.0, -0.5, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(b.seed), [7, 101, 102, 0])
    np.testing.assert_array_equal(np.asarray(b.step), [0, 3, 6, 0])


def test_prompt_steps_carry_each_request_s_logit_bias():
    """A prompt step's packed input carries every request's logit bias (ids -1 and biases 0 past
    its entries, padding rows empty), which the step writes into the request's slot; decode steps
    read it there and carry none."""
    params = [SamplingParams(logit_bias={"7": 2.5, 3: -100}), SamplingParams()]
    reqs = []
    for i, sp in enumerate(params):
        r = Request(rid=str(i), input_ids=[3, 4], sampling=sp, seed=i)
        r.slot = i + 1
        reqs.append(ScheduledReq(r, 0, [3, 4], True, True, 0))
    bucket = Bucket(ForwardMode.EXTEND, 8, 4, 4)
    x = bucket.unpack(jnp.asarray(pack(StepPlan(ForwardMode.EXTEND, reqs, []), bucket)))
    ids, values = np.asarray(x["logit_bias_ids"]), np.asarray(x["logit_bias_values"])
    assert ids.shape == values.shape == (4, MAX_LOGIT_BIAS)
    np.testing.assert_array_equal(ids[0, :3], [3, 7, -1])
    np.testing.assert_array_equal(values[0, :2], [-100.0, 2.5])
    assert (ids[1:] == -1).all() and not values[1:].any() and (ids[0, 2:] == -1).all()
    assert "logit_bias_ids" not in dict(Bucket(ForwardMode.DECODE, 4, 4, 4).fields())


def test_update_counts_one_and_many_tokens_per_row():
    counts = jnp.zeros((4, 10), jnp.int32)
    counts = update_counts(counts, jnp.asarray([2, 0, 2]), jnp.asarray([5, 5, 5]), jnp.asarray([True, True, False]))
    expected = np.zeros((4, 10), np.int32)
    expected[2, 5] = expected[0, 5] = 1
    np.testing.assert_array_equal(np.asarray(counts), expected)
    # A speculative step: several accepted tokens per row, duplicates included, padding masked out.
    tokens = jnp.asarray([[1, 1, 2], [4, 0, -1]])
    mask = jnp.asarray([[True, True, True], [True, True, False]])
    counts = update_counts(counts, jnp.asarray([1, 3]), tokens, mask)
    expected[1, 1] += 2
    expected[1, 2] += 1
    expected[3, 4] += 1
    expected[3, 0] += 1
    np.testing.assert_array_equal(np.asarray(counts), expected)


def test_prompt_mask_and_reset_slots():
    mask = jnp.zeros((3, 10), jnp.bool_)
    slots = jnp.asarray([0, 0, 2, 2, 2, 0])
    token_ids = jnp.asarray([1, 1, 7, 7, 3, -1])
    valid = jnp.asarray([True, True, True, False, False, False])
    mask = add_prompt_tokens(mask, slots, token_ids, valid)
    expected = np.zeros((3, 10), bool)
    expected[0, 1] = expected[2, 7] = True
    np.testing.assert_array_equal(np.asarray(mask), expected)

    counts = jnp.ones((3, 10), jnp.int32)
    counts, mask = reset_slots(counts, mask, jnp.asarray([2, 3]))  # 3 = num_slots: padding, dropped
    expected[2] = False
    np.testing.assert_array_equal(np.asarray(mask), expected)
    np.testing.assert_array_equal(np.asarray(counts).sum(1), [10, 10, 0])
