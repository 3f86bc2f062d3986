"""The two-part prompt-chunk attention (`paged_attention/prefill.py`: each request's own tokens,
then the kernel over its cached prefix starting from their softmax, in place; requests past the
own part's segments the kernel's whole causal path) against the reference's causal ragged
attention, in interpret mode with the jnp stand-in for cuDNN: requests with and without a prefix,
requests with no new tokens, padding tokens, and NaN in every slot no request owns. The cuDNN part's glue runs against a fake of JAX's cuDNN call."""

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
    # the chunk's own k / v as the attention-input kernel hands them over; padding tokens: NaN
    k_tok = np.where((slots >= 0)[:, None, None], k.reshape(-1, kv_heads, head_dim)[np.maximum(slots, 0)], np.nan)
    v_tok = np.where((slots >= 0)[:, None, None], v.reshape(-1, kv_heads, head_dim)[np.maximum(slots, 0)], np.nan)
    q = rng.standard_normal((tokens, heads, head_dim))
    seq = np.asarray([p + n for p, n in zip(prefixes, q_lens)], np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table),
            jnp.asarray(seq), jnp.asarray(cu)), (jnp.asarray(k_tok, dtype), jnp.asarray(v_tok, dtype))


@pytest.mark.parametrize("q_lens,prefixes,tokens,heads,kv_heads,head_dim,dtype,segments", [
    ([7, 3, 9, 0], [0, 5, 13, 0], 24, 8, 2, 32, jnp.float32, 8),  # prefixes off a page boundary, padding
    ([7, 3, 9, 0], [0, 5, 13, 0], 24, 8, 2, 32, jnp.float32, 2),  # the third request: the kernel alone
    ([12], [0], 12, 4, 4, 32, jnp.float32, 8),  # one request, nothing cached: the own part alone
    ([9, 0, 0], [13, 0, 0], 24, 8, 2, 32, jnp.float32, 8),  # one request over a prefix
    ([5, 6], [8, 17], 16, 4, 1, 64, jnp.bfloat16, 8),
    ([5, 6], [8, 17], 16, 4, 1, 64, jnp.bfloat16, 1),
    ([0, 4, 3], [0, 0, 9], 8, 4, 2, 32, jnp.float32, 8),  # a request without new tokens before others
])
def test_prefill_attention_matches_causal_reference(q_lens, prefixes, tokens, heads, kv_heads, head_dim, dtype,
                                                    segments, monkeypatch):
    from pallas_kernels.paged_attention import prefill

    def poisoned(q, k, v, cu_q_lens, *, sm_scale, segments):
        """The stand-in, with NaN in every row past the covered requests (cuDNN leaves those rows
        unwritten): the kernel must overwrite them all, padding with zeros."""
        out, lse, seg = own_part_reference(q, k, v, cu_q_lens, sm_scale=sm_scale, segments=segments)
        end = cu_q_lens[min(segments, cu_q_lens.shape[0] - 1)]
        return jnp.where((jnp.arange(q.shape[0]) < end)[:, None, None], out, jnp.nan), lse, seg

    monkeypatch.setitem(prefill.OWN_PARTS, "reference", poisoned)
    rng = np.random.default_rng(sum(q_lens) + heads)
    args, (k_tok, v_tok) = _chunk(rng, q_lens, prefixes, tokens, heads, kv_heads, head_dim, dtype)
    want = np.asarray(ref.paged_attention(*args, sm_scale=0.3).astype(jnp.float32))
    q, rest = args[0], args[1:]
    got = jax.jit(lambda *a: pa.prefill_attention(*a, sm_scale=0.3, own="reference", own_segments=segments,
                                                  interpret=True))(q, k_tok, v_tok, *rest)
    got = np.asarray(got.astype(jnp.float32))
    assert got.shape == want.shape and np.isfinite(got).all()
    # bf16: the own part is rounded to bf16 before the prefix merges into it, as cuDNN's would be
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert (got[sum(q_lens):] == 0).all()  # padding tokens


def test_a_request_without_kv_gives_zeros():
    """A drafter's catch-up extend marks the rows it skips with a KV length of 0 but keeps their
    new tokens: the reference gives those rows zeros, and so must both parts."""
    rng = np.random.default_rng(5)
    args, (k_tok, v_tok) = _chunk(rng, [4, 4, 4], [3, 3, 3], 12, 4, 2, 32, jnp.float32)
    q, k, v, table, seq, cu = args
    seq = seq.at[1].set(0)
    want = np.asarray(ref.paged_attention(q, k, v, table, seq, cu, sm_scale=0.3))
    got = np.asarray(pa.prefill_attention(q, k_tok, v_tok, k, v, table, seq, cu, sm_scale=0.3, own="reference",
                                          own_segments=2, interpret=True))
    assert (want[4:8] == 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_own_part_reference_log_sum_exp():
    """The stand-in's lse is log sum exp of each token's scaled logits over its request's earlier
    tokens (what the kernel resumes from), and -inf for padding tokens."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((6, 1, 8)), jnp.float32)
    cu = jnp.asarray([0, 2, 5], jnp.int32)
    _, lse, seg = own_part_reference(q, k, k, cu, sm_scale=0.5, segments=8)
    qn, kn, lse = np.asarray(q), np.asarray(k)[:, 0], np.asarray(lse)
    assert list(np.asarray(seg)) == [0, 1] and lse.shape == (2, 2, 6)
    for t, (b, start, idx) in enumerate([(0, 0, 0), (0, 0, 1), (1, 2, 0), (1, 2, 1), (1, 2, 2)]):
        logits = qn[t] @ kn[start:start + idx + 1].T * 0.5  # [H, n]
        np.testing.assert_allclose(lse[b, :, idx], np.log(np.exp(logits).sum(-1)), rtol=1e-5)
    assert np.isneginf(lse[0, :, 2:]).all() and np.isneginf(lse[1, :, 3:]).all()  # past each request


def test_cudnn_part_glue_against_a_fake_cudnn(monkeypatch):
    """own_part_cudnn describes the covered requests as packed segments (-1 for those without new
    tokens, at least two segments) and points each covered request at its segment of cuDNN's
    `[M, H, T]` float32 log-sum-exp: with a fake that answers as JAX's cuDNN call does, rows and
    log-sum-exp equal the jnp stand-in's."""
    from pallas_kernels.paged_attention import prefill

    class FakeCudnn:
        class MaskType:
            PADDING_CAUSAL = "padding_causal"

        @staticmethod
        def dot_product_attention(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type,
                                  return_residual):
            assert mask_type == "padding_causal" and return_residual
            segs = q_seqlen.shape[1]
            assert segs >= 2 and q_offsets.shape == (1, segs + 1) and (q_seqlen == kv_seqlen).all()
            lens = [int(n) for n in np.asarray(q_seqlen[0]) if n >= 0]  # packed to the left, as JAX does
            starts = [int(o) for o in np.asarray(q_offsets[0]) if o >= 0]
            t = q.shape[1]
            out = jnp.zeros_like(q[0])
            stat = jnp.full((segs, q.shape[2], t), jnp.nan, jnp.float32)
            for i, (o, n) in enumerate(zip(starts, lens)):
                cu = jnp.asarray([0, n], jnp.int32)
                so, sl, _ = own_part_reference(q[0, o:o + n], k[0, o:o + n], v[0, o:o + n], cu, sm_scale=scale,
                                            segments=1)
                out = out.at[o:o + n].set(so)
                stat = stat.at[i, :, :n].set(sl[0, :, :n])
            return out[None], stat

    monkeypatch.setattr(prefill, "_cudnn", FakeCudnn)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((12, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((12, 2, 16)), jnp.float32)
    # one request (padded to two segments); empty requests between; requests past the segments
    for cu, segments in (([0, 7], 8), ([0, 0, 3, 3, 10], 8), ([0, 2, 5, 9, 11], 2)):
        cu = jnp.asarray(cu, jnp.int32)
        want = own_part_reference(q, k, k, cu, sm_scale=0.25, segments=segments)
        got = prefill.own_part_cudnn(q, k, k, cu, sm_scale=0.25, segments=segments)
        n = int(cu[min(segments, len(cu) - 1)])  # rows past the covered requests: not in the contract
        np.testing.assert_allclose(np.asarray(got[0][:n]), np.asarray(want[0][:n]), rtol=1e-5, atol=1e-6)
        lens = np.diff(np.asarray(cu))
        packed = np.cumsum(lens[:segments] > 0) - 1
        want_seg = [int(packed[b]) if b < segments and lens[b] else -1 for b in range(len(lens))]
        assert list(np.asarray(got[2])) == want_seg
        for b, s in enumerate(want_seg):
            if s >= 0:
                np.testing.assert_allclose(np.asarray(got[1][s, :, :lens[b]]), np.asarray(want[1][b, :, :lens[b]]),
                                           rtol=1e-5, atol=1e-6)


def test_cudnn_part_is_offered_for_half_precision_on_hopper_only():
    dev = jax.devices()[0]
    hopper = dev.platform == "gpu" and float(getattr(dev, "compute_capability", "0") or 0) >= 9.0
    assert pa.cudnn_available(jnp.bfloat16) == hopper and pa.cudnn_available(jnp.float16) == hopper
    assert not pa.cudnn_available(jnp.float32)
