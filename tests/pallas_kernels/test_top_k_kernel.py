"""The Pallas top-k kernel (pallas_kernels/top_k) in interpret mode against lax.top_k: values, ids
and tie order, with ties, -inf and NaN entries, signed zeros, rows shorter than a block, blocks
that hold fewer than k entries and one to three rounds."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.top_k import top_k


@functools.lru_cache(maxsize=None)
def kernel(k, block, threshold=False):
    return jax.jit(lambda x: top_k(x, k, block=block, interpret=True, threshold=threshold))


def check(x, k, block, threshold=False):
    got_vals, got_ids = kernel(k, block, threshold)(jnp.asarray(x))
    want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(got_vals), np.asarray(want_vals))  # NaN == NaN here


@pytest.mark.parametrize("rows,n,k,block", [
    (3, 5000, 20, 1024),  # 5 blocks of 32 candidates: two rounds
    (2, 9000, 20, 256),  # 36 blocks: three rounds
    (4, 2049, 33, 512),  # the last block holds one entry: fewer than k
    (1, 40, 20, 4096),  # a row shorter than a block
    (5, 3000, 1, 256),
    (2, 300, 300, 64),  # k = N
    (2, 1500, 20, 32),  # a block no wider than k's slots: widened, so the rounds shrink
    (3, 20000, 5, 256),  # 79 blocks: most below the threshold
])
@pytest.mark.parametrize("threshold", [False, True])  # (only where there are more blocks than k)
def test_top_k_equals_lax_with_ties_and_minus_inf(rows, n, k, block, threshold):
    rng = np.random.default_rng(n + k)
    x = rng.integers(-4, 4, size=(rows, n)).astype(np.float32)  # few distinct values: many ties
    x[rng.random((rows, n)) < 0.3] = -np.inf
    x[0] = -np.inf  # fewer finite entries than k: the rest is -inf, ranked by id
    x[0, rng.integers(0, n, 3)] = 1.0
    check(x, k, block, threshold)


def test_top_k_orders_nan_and_signed_zeros_as_lax():
    x = np.array([[1.0, np.nan, 3.0, np.inf, -np.inf, np.nan, -0.0, 0.0, -np.nan, -np.inf, -0.0, 0.0]], np.float32)
    check(np.tile(x, (2, 40)), 30, 64)
    check(np.tile(x, (2, 40)), 3, 64, threshold=True)  # NaN blocks set the threshold


def test_the_threshold_keeps_the_k_best_of_one_crowded_block():
    """A row whose k best all sit in one block (and whose other blocks' maxima tie the threshold):
    the threshold skips every other block and still returns lax.top_k's."""
    x = np.full((2, 4096), -3.0, np.float32)
    x[:, 700:720] = np.arange(20, dtype=np.float32)  # the 20 best, all in block 2 of 16
    x[1, ::256] = 19.0  # row 1: every block's first entry ties the best value
    check(x, 8, 256, threshold=True)


def test_top_k_of_bfloat16_rows():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 3000), jnp.bfloat16)  # bf16: many equal values
    check(x, 20, 512)


def test_top_k_rejects_k_outside_the_row():
    with pytest.raises(ValueError, match=r"k=9 must be in \[1, 8\]"):
        top_k(jnp.zeros((2, 8)), 9, interpret=True)


def test_top_k_of_chosen_rows_only():
    """`rows` leaves rows out: the kept rows equal lax.top_k's, the others are zeros (ids 0), over
    one and several rounds; the reference does the same."""
    from pallas_kernels.top_k import reference

    x = jax.random.normal(jax.random.PRNGKey(1), (5, 9000), jnp.float32)
    rows = jnp.asarray([True, False, True, False, False])
    want_vals, want_ids = jax.lax.top_k(x, 20)
    for block, threshold in ((1024, False), (256, False), (256, True)):
        vals, ids = jax.jit(lambda x, r, b=block, t=threshold: top_k(x, 20, r, block=b, interpret=True,
                                                                      threshold=t))(x, rows)
        ref_vals, ref_ids = reference.top_k(x, 20, rows)
        for got_v, got_i in ((vals, ids), (ref_vals, ref_ids)):
            np.testing.assert_array_equal(np.asarray(got_i)[[0, 2]], np.asarray(want_ids)[[0, 2]])
            np.testing.assert_array_equal(np.asarray(got_v)[[0, 2]], np.asarray(want_vals)[[0, 2]])
            assert not np.asarray(got_i)[[1, 3, 4]].any() and not np.asarray(got_v)[[1, 3, 4]].any()
    with pytest.raises(ValueError, match=r"rows \(3,\) must be \[5\]"):
        top_k(x, 20, rows[:3], interpret=True)
