"""Pallas paged attention (interpret mode) against the jnp reference.

Every case draws fresh random inputs, fills every KV slot that no request owns with NaN (other
pages, the tail of each last page, page-table entries past a request's pages point at poisoned
or foreign pages) and poisons padding queries with NaN; then checks every output element.
Shapes stay static per compiled function and small, so interpret mode stays fast: only lengths,
page tables and masks change between cases.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import reference as ref
from pallas_kernels.paged_attention.attention import pack_tree_mask, paged_attention_tuned, paged_decode_tuned
from pallas_kernels.paged_attention.combine import combine_decode, combine_splits

SM_SCALE = 0.37


def make_case(rng, q_lens, prefixes, *, T, Pmax, P=48, L=4, G=2, H=4, D=16, dtype=np.float32):
    """Random ragged step: q [T, H, D], NaN-poisoned pages, page table, lengths, cu_q_lens."""
    q_lens = np.asarray(q_lens, np.int32)
    seq = np.asarray(prefixes, np.int32) + q_lens
    B = len(q_lens)
    assert q_lens.sum() <= T and (-(-seq // L)).max(initial=0) <= Pmax and B * Pmax < P
    pages = rng.permutation(np.arange(1, P))  # page 0: the padding sink, never owned
    page_table = rng.integers(0, P, size=(B, Pmax)).astype(np.int32)  # leftovers point anywhere
    k = np.full((P, L, G, D), np.nan, np.float32)
    v = np.full((P, L, G, D), np.nan, np.float32)
    for b in range(B):
        n = -(-seq[b] // L)
        own = pages[b * Pmax: b * Pmax + n]
        page_table[b, :n] = own
        for s in range(seq[b]):
            k[own[s // L], s % L] = rng.standard_normal((G, D))
            v[own[s // L], s % L] = rng.standard_normal((G, D))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    q[cu[-1]:] = np.nan
    cast = lambda x: jnp.asarray(x).astype(dtype)
    return (cast(q), cast(k), cast(v), jnp.asarray(page_table), jnp.asarray(seq), jnp.asarray(cu))


def random_tree(rng, B, N):
    """EAGLE-style tree masks: token j sees itself and its ancestors (parent index < j)."""
    mask = np.zeros((B, N, N), bool)
    for b in range(B):
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, N)]
        for j in range(N):
            a = j
            while a >= 0:
                mask[b, j, a] = True
                a = parent[a]
    return jnp.asarray(mask)


def check(out, expected, q_len_total, *, rtol=2e-5, atol=2e-5):
    out = np.asarray(out.astype(jnp.float32))
    expected = np.asarray(expected.astype(jnp.float32))
    assert out.shape == expected.shape
    assert np.isfinite(out).all(), "NaN/inf leaked into the output"
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol)
    assert (out[q_len_total:] == 0).all(), "padding tokens must give zeros"


@functools.lru_cache(maxsize=None)
def attention_fn(mode, **tuning):
    return jax.jit(functools.partial(paged_attention_tuned, sm_scale=SM_SCALE, mask_mode=mode, interpret=True,
                                     **tuning))


@functools.lru_cache(maxsize=None)
def reference_fn(mode):
    return jax.jit(functools.partial(ref.paged_attention, sm_scale=SM_SCALE, mask_mode=mode))


# ----------------------------------------------------------------------------- ragged extend

# (q_lens, prefixes): zero-length and single-token requests, page-boundary crossings (L = 4),
# a request whose KV exactly fills its pages, and one that starts with no cache at all.
EXTEND_BATCHES = [
    ([5, 0, 1, 7], [6, 0, 11, 0]),
    ([1, 1, 1, 1], [0, 3, 4, 19]),
    ([13], [3]),
    ([0, 0, 2, 0], [0, 9, 2, 0]),
]


@pytest.mark.parametrize("mode", ["causal", "full"])
@pytest.mark.parametrize("batch", EXTEND_BATCHES)
def test_extend_default_launch(mode, batch):
    """The public function with its own launch choices (what the engine calls)."""
    rng = np.random.default_rng()
    args = make_case(rng, *batch, T=16, Pmax=6)
    out = pa.paged_attention(*args, sm_scale=SM_SCALE, mask_mode=mode, interpret=True)
    check(out, reference_fn(mode)(*args), int(args[-1][-1]))


@pytest.mark.parametrize(
    "tuning",
    [
        dict(block_q=2, block_kv=8, splits=2),  # several query blocks per request, 2-page KV steps
        dict(block_q=4, block_kv=4, splits=3),  # a KV step of exactly one page, 3 splits
        dict(block_q=1, block_kv=16, splits=1),  # one token per block, whole context in one step
    ],
)
@pytest.mark.parametrize("mode", ["causal", "full"])
def test_extend_launch_shapes(mode, tuning):
    """Launch shapes change how blocks, steps and splits cut the work, never the result."""
    rng = np.random.default_rng()
    fn = attention_fn(mode, **tuning)
    for batch in EXTEND_BATCHES[:2]:
        args = make_case(rng, *batch, T=16, Pmax=6)
        check(fn(*args), reference_fn(mode)(*args), int(args[-1][-1]))


@st.composite
def ragged_batches(draw, B=4, T=16, Pmax=6, L=4):
    q_lens, prefixes, room = [], [], T
    for _ in range(B):
        q = draw(st.integers(0, min(room, 9)))
        room -= q
        q_lens.append(q)
        prefixes.append(draw(st.integers(0, Pmax * L - q)))
    return q_lens, prefixes


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=ragged_batches(), seed=st.integers(0, 2**31 - 1))
def test_extend_property(batch, seed):
    """Any ragged batch within the bucket: causal and full match the reference."""
    rng = np.random.default_rng(seed)
    args = make_case(rng, *batch, T=16, Pmax=6)
    for mode in ("causal", "full"):
        check(attention_fn(mode, block_q=4, block_kv=8, splits=2)(*args), reference_fn(mode)(*args),
              int(args[-1][-1]))


# ----------------------------------------------------------------------------- tree verify


@pytest.mark.parametrize(
    "N, q_lens, prefixes",
    [
        (4, [4, 4, 0], [7, 0, 5]),  # a request with no cache, a padded-out request
        (7, [7, 3, 1], [2, 13, 0]),  # requests that verify fewer than N tokens
        (1, [1, 1, 1], [5, 0, 8]),  # N = 1 is decode
        (40, [40, 9], [2, 21]),  # N > 32: two mask words per row
    ],
)
def test_tree_verify(N, q_lens, prefixes):
    rng = np.random.default_rng()
    B = len(q_lens)
    T = max(16, int(np.sum(q_lens)) + 3)
    Pmax = -(-(max(p + q for p, q in zip(prefixes, q_lens))) // 4)
    args = make_case(rng, q_lens, prefixes, T=T, Pmax=Pmax, P=B * Pmax + 8)
    for mask in (random_tree(rng, B, N), jnp.asarray(rng.random((B, N, N)) < 0.5)):
        out = pa.paged_attention(*args, sm_scale=SM_SCALE, mask_mode="tree", custom_mask=mask, interpret=True)
        expected = ref.paged_attention(*args, sm_scale=SM_SCALE, mask_mode="tree", custom_mask=mask)
        check(out, expected, int(args[-1][-1]))
        # Trees wider than one program's rows are cut into several query blocks.
        out = paged_attention_tuned(*args, sm_scale=SM_SCALE, mask_mode="tree", custom_mask=mask, interpret=True,
                                    block_q=3, block_kv=8, splits=2)
        check(out, expected, int(args[-1][-1]))


def test_tree_with_causal_mask_equals_causal():
    """A lower-triangular tree is a linear chain: tree mode must then equal causal mode."""
    rng = np.random.default_rng()
    args = make_case(rng, [4, 4, 4], [9, 0, 3], T=16, Pmax=6)
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((4, 4), bool)), (3, 4, 4))
    out = pa.paged_attention(*args, sm_scale=SM_SCALE, mask_mode="tree", custom_mask=chain, interpret=True)
    check(out, reference_fn("causal")(*args), 12)


def test_pack_tree_mask_bits():
    rng = np.random.default_rng()
    mask = rng.random((2, 37, 37)) < 0.5
    words = np.asarray(pack_tree_mask(jnp.asarray(mask))).view(np.uint32)
    cols = np.arange(37)
    unpacked = (words[:, :, cols // 32] >> (cols % 32)) & 1
    np.testing.assert_array_equal(unpacked.astype(bool), mask)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("H, G", [(4, 4), (8, 1), (8, 2)])
@pytest.mark.parametrize("tuning", [{}, dict(block_kv=4, splits=3), dict(block_kv=8, splits=2)])
def test_decode(H, G, tuning):
    rng = np.random.default_rng()
    prefixes = [0, 7, 3, 22, -1]  # seq_len 0 (padding request), page-exact and crossing lengths
    q_lens = [0 if p < 0 else 1 for p in prefixes]
    args = make_case(rng, q_lens, [max(p, 0) for p in prefixes], T=5, Pmax=6, H=H, G=G)
    q, k, v, pt, seq, _ = args
    q = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    out = paged_decode_tuned(q, k, v, pt, seq, sm_scale=SM_SCALE, interpret=True, **tuning)
    expected = ref.paged_decode(q, k, v, pt, seq, sm_scale=SM_SCALE)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=2e-5, atol=2e-5)
    assert (np.asarray(out)[4] == 0).all()


@pytest.mark.parametrize("splits", [2, 8])
def test_decode_splits_share_the_actual_kv(splits):
    """A page table far wider than the requests' KV (an engine's is its longest context): the
    splits divide each request's own length, in whole KV steps, so short requests leave some
    splits empty and long ones use them all; every split count gives the reference."""
    rng = np.random.default_rng(splits)
    prefixes = [0, 5, 17, 40, 63]
    args = make_case(rng, [1] * 5, prefixes, T=5, Pmax=40, P=208, H=4, G=2)
    q, k, v, pt, seq, _ = args
    out = paged_decode_tuned(q, k, v, pt, seq, sm_scale=SM_SCALE, interpret=True, block_kv=4, splits=splits)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref.paged_decode(q, k, v, pt, seq, sm_scale=SM_SCALE)),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits, group, head_dim", [(16, 4, 128), (2, 8, 64), (4, 1, 32), (128, 8, 256)])
def test_combine_decode_equals_the_jnp_merge(splits, group, head_dim):
    """Decode's one-kernel merge gives the jnp merge's first `group` rows as heads, across its
    loop over split chunks and its blocks of D (16 x 4 x 128: two blocks of 64; 128 x 8 x 256:
    sixteen blocks of 16, four chunks each), with empty splits (max -inf) and a row that
    saw nothing anywhere (zeros, not NaN)."""
    rng = np.random.default_rng(splits)
    batch, num_kv_heads, rows = 3, 2, 16
    acc = jnp.asarray(rng.standard_normal((batch, num_kv_heads, splits, rows, head_dim)), jnp.float32)
    m = rng.standard_normal((batch, num_kv_heads, splits, rows)).astype(np.float32) * 4
    l = rng.uniform(0.5, 3.0, m.shape).astype(np.float32)
    m[0, :, splits // 2:] = -np.inf  # a short request: its later splits had no KV
    l[0, :, splits // 2:] = 0
    m[2, 1] = -np.inf  # a padding request: nothing anywhere
    l[2, 1] = 0
    acc = acc.at[0, :, splits // 2:].set(0).at[2, 1].set(0)
    out = combine_decode(acc, jnp.asarray(m), jnp.asarray(l), group, jnp.float32, interpret=True)
    want = combine_splits(acc, jnp.asarray(m), jnp.asarray(l), jnp.float32)[:, :, :group]
    assert out.shape == (batch, num_kv_heads * group, head_dim)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want).reshape(out.shape), rtol=1e-6, atol=1e-6)
    assert (np.asarray(out)[2, group:] == 0).all()


def test_decode_public_and_page_sizes():
    """The public decode with L = 8 and D = 32 (another page size and head dim)."""
    rng = np.random.default_rng()
    args = make_case(rng, [1, 1, 1], [0, 8, 30], T=3, Pmax=4, L=8, D=32, P=20)
    q, k, v, pt, seq, _ = args
    out = pa.paged_decode(q, k, v, pt, seq, sm_scale=SM_SCALE, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref.paged_decode(q, k, v, pt, seq, sm_scale=SM_SCALE)),
                               rtol=2e-5, atol=2e-5)


def test_bfloat16_extend():
    """bf16 inputs: compared with the reference on the same values upcast to f32."""
    rng = np.random.default_rng()
    args = make_case(rng, [5, 1, 7], [6, 11, 0], T=16, Pmax=6, dtype=jnp.bfloat16)
    out = pa.paged_attention(*args, sm_scale=SM_SCALE, interpret=True)
    assert out.dtype == jnp.bfloat16
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    check(out, ref.paged_attention(*f32, sm_scale=SM_SCALE), 13, rtol=2e-2, atol=2e-2)
