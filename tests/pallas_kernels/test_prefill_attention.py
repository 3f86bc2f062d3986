"""The two-part prompt-chunk attention (`paged_attention/prefill.py`: a request's own tokens, then
the kernel over its cached prefix starting from their softmax) against the reference's causal
ragged attention, in interpret mode with the jnp stand-in for cuDNN: one request with and without a
prefix, several requests (the kernel alone), requests with no new tokens, padding tokens, and NaN in
every slot no request owns. The cuDNN part's glue runs against a fake of JAX's cuDNN call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import reference as ref
from pallas_kernels.paged_attention.prefill import own_part_reference

PAGE = 4


def _chunk(rng, q_lens, prefixes, tokens, heads, kv_heads, head_dim, dtype, pages_per_seq=8):
    """A prompt step: pages with NaN outside the requests' KV, page tables, slots of the new tokens."""
    batch = len(q_lens)
    num_pages = batch * pages_per_seq + 3
    k = rng.standard_normal((num_pages, PAGE, kv_heads, head_dim))
    v = rng.standard_normal((num_pages, PAGE, kv_heads, head_dim))
    owned = np.zeros((num_pages, PAGE), bool)
    table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    slots = np.full(tokens, -1, np.int32)
    for b in range(batch):
        for pos in range(prefixes[b] + q_lens[b]):
            owned[table[b, pos // PAGE], pos % PAGE] = True
        for j in range(q_lens[b]):
            pos = prefixes[b] + j
            slots[cu[b] + j] = table[b, pos // PAGE] * PAGE + pos % PAGE
    k[~owned], v[~owned] = np.nan, np.nan
    q = rng.standard_normal((tokens, heads, head_dim))
    seq = np.asarray([p + n for p, n in zip(prefixes, q_lens)], np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table),
            jnp.asarray(seq), jnp.asarray(cu)), jnp.asarray(slots)


@pytest.mark.parametrize("q_lens,prefixes,tokens,heads,kv_heads,head_dim,dtype", [
    ([9, 0, 0], [13, 0, 0], 24, 8, 2, 32, jnp.float32),  # one request over a prefix off a page boundary
    ([12], [0], 12, 4, 4, 32, jnp.float32),  # one request, nothing cached: the own part alone
    ([11, 0], [17, 0], 16, 4, 1, 64, jnp.bfloat16),
    ([7, 3, 9, 0], [0, 5, 13, 0], 24, 8, 2, 32, jnp.float32),  # several requests: the kernel alone
])
def test_prefill_attention_matches_causal_reference(q_lens, prefixes, tokens, heads, kv_heads, head_dim, dtype):
    rng = np.random.default_rng(sum(q_lens) + heads)
    args, slots = _chunk(rng, q_lens, prefixes, tokens, heads, kv_heads, head_dim, dtype)
    want = np.asarray(ref.paged_attention(*args, sm_scale=0.3).astype(jnp.float32))
    got = jax.jit(lambda *a: pa.prefill_attention(*a, sm_scale=0.3, own="reference", interpret=True))(*args, slots)
    got = np.asarray(got.astype(jnp.float32))
    assert got.shape == want.shape and np.isfinite(got).all()
    # bf16: the own part is rounded to bf16 before the prefix merges into it, as cuDNN's would be
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert (got[sum(q_lens):] == 0).all()  # padding tokens


def test_own_part_reference_log_sum_exp():
    """The stand-in's lse is log sum exp of each token's scaled logits over its request's earlier
    tokens (what the kernel resumes from), and -inf for padding tokens."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((6, 1, 8)), jnp.float32)
    cu = jnp.asarray([0, 2, 5], jnp.int32)
    _, lse = own_part_reference(q, k, k, cu, sm_scale=0.5)
    qn, kn = np.asarray(q), np.asarray(k)[:, 0]
    for t, (start, idx) in enumerate([(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]):
        logits = qn[t] @ kn[start:start + idx + 1].T * 0.5  # [H, n]
        np.testing.assert_allclose(np.asarray(lse[t]), np.log(np.exp(logits).sum(-1)), rtol=1e-5)
    assert np.isneginf(np.asarray(lse[5])).all()


def test_cudnn_part_glue_against_a_fake_cudnn(monkeypatch):
    """own_part_cudnn hands cuDNN request 0's length and reads its `[1, H, T]` float32 log-sum-exp
    back per token: with a fake that answers as cuDNN does, it equals the jnp stand-in."""
    from pallas_kernels.paged_attention import prefill

    class FakeCudnn:
        class MaskType:
            PADDING_CAUSAL = "padding_causal"

        @staticmethod
        def dot_product_attention(q, k, v, *, q_seqlen, kv_seqlen, scale, mask_type, return_residual):
            assert mask_type == "padding_causal" and return_residual and q_seqlen.shape == (1,)
            t = q.shape[1]
            cu = jnp.stack([0, q_seqlen[0]]).astype(jnp.int32)
            out, lse = own_part_reference(q[0], k[0], v[0], cu, sm_scale=scale)
            return out[None], lse.T[None]  # cuDNN's stat layout: [B, H, T]

    monkeypatch.setattr(prefill, "_cudnn", FakeCudnn)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((10, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((10, 2, 16)), jnp.float32)
    cu = jnp.asarray([0, 7, 7, 7], jnp.int32)
    want = own_part_reference(q, k, k, cu, sm_scale=0.25)
    got = prefill.own_part_cudnn(q, k, k, cu, sm_scale=0.25)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    assert np.isneginf(np.asarray(got[1][7:])).all() and (np.asarray(got[0][7:]) == 0).all()


def test_cudnn_part_is_not_offered_off_the_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU run: whether cuDNN's part runs depends on the card")
    assert not pa.cudnn_available(jnp.bfloat16)
