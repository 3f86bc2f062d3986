"""Random Gated DeltaNet inputs for the GDN kernel tests (and a check of the helpers themselves).

Every draw is fresh. Whatever a correct kernel must not read is NaN: padding tokens past
cu_seqlens[B], pool slots that no request continues from (fresh requests' slots included), so a
kernel that reads them produces NaN where the reference does not.
"""

from __future__ import annotations

import numpy as np

DIMS = dict(Hk=2, Hv=4, dk=16, dv=32)  # GVA with two value heads per key head


def cu_from_lens(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def token_inputs(rng, num_tokens, num_valid, *, Hk, Hv, dk, dv):
    """q, k [T, Hk, dk]; v [T, Hv, dv]; g (log decay, < 0), beta in (0, 1) [T, Hv]; padding NaN."""
    q = rng.standard_normal((num_tokens, Hk, dk)).astype(np.float32)
    k = rng.standard_normal((num_tokens, Hk, dk)).astype(np.float32)
    v = rng.standard_normal((num_tokens, Hv, dv)).astype(np.float32)
    # g = -exp(A_log) * softplus(a + dt_bias) as in Qwen3-Next: negative, mostly small.
    g = (-np.exp(rng.normal(-1.0, 0.5, (1, Hv))) * np.log1p(np.exp(rng.normal(0.0, 1.5, (num_tokens, Hv)))))
    beta = 1.0 / (1.0 + np.exp(-rng.normal(0.0, 1.5, (num_tokens, Hv))))
    out = [q, k, v, g.astype(np.float32), beta.astype(np.float32)]
    for x in out:
        x[num_valid:] = np.nan
    return out


def state_pool(rng, num_slots, slots, has_initial, *, Hv, dk, dv):
    """Pool with valid states only in the slots that requests continue from; NaN elsewhere."""
    pool = np.full((num_slots, Hv, dk, dv), np.nan, np.float32)
    for s, init in zip(slots, has_initial):
        if init:
            pool[s] = 0.3 * rng.standard_normal((Hv, dk, dv))
    return pool


def conv_pool(rng, num_slots, slots, has_initial, channels, width):
    pool = np.full((num_slots, channels, width - 1), np.nan, np.float32)
    for s, init in zip(slots, has_initial):
        if init:
            pool[s] = rng.standard_normal((channels, width - 1))
    return pool


def random_slots(rng, batch, num_slots):
    return rng.permutation(num_slots)[:batch].astype(np.int32)


def random_lens(rng, batch, max_total, max_len):
    """Ragged lengths with zero-length and single-token requests mixed in."""
    lens = rng.integers(0, max_len + 1, batch)
    lens[rng.random(batch) < 0.2] = 0
    lens[rng.random(batch) < 0.2] = 1
    while lens.sum() > max_total:
        lens[rng.integers(batch)] //= 2
    return lens.astype(np.int32)


def parents_of(kind, rng, n):
    """Draft-token parent arrays: parents[j] < j, -1 = the committed state."""
    if kind == "chain":
        return np.arange(-1, n - 1)
    if kind == "star":
        return np.full(n, -1)
    if kind == "tree":
        return np.array([-1] + [int(rng.integers(-1, j)) for j in range(1, n)])
    if kind == "two_branches":  # 0-1-2... and a second branch from the root at the middle
        half = n // 2
        return np.array([-1] + list(range(half - 1)) + [-1] + list(range(half, n - 1)))[:n]
    raise ValueError(kind)


def assert_close(actual, expected, *, tol=1e-4, what=""):
    """Every element, NaN where the reference has NaN (untouched poisoned slots) and nowhere else."""
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"{what}: NaN pattern")
    scale = max(1.0, float(np.nanmax(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, equal_nan=True, err_msg=what)


def test_parents_are_causal():
    rng = np.random.default_rng(0)
    for kind in ("chain", "star", "tree", "two_branches"):
        p = parents_of(kind, rng, 7)
        assert p.shape == (7,) and p[0] == -1 and all(p[j] < j for j in range(7)), (kind, p)


def test_random_lens_fit():
    rng = np.random.default_rng(1)
    for _ in range(20):
        lens = random_lens(rng, 5, 100, 70)
        assert lens.sum() <= 100 and lens.min() >= 0
