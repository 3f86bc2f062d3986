"""Causal attention of a prompt chunk in two parts: each request's new tokens over themselves
through cuDNN's flash attention (the first `OWN_SEGMENTS` requests as segments of one packed
sequence), then over the request's cached prefix through this package's kernel, which starts its
online softmax from cuDNN's rows and log-sum-exp (requests past those segments take the kernel's
whole causal path).

Why two parts: a long chunk's T x T causal block is compute-bound, and there cuDNN's Hopper kernel
outruns what the Triton lowering reaches (NOTES.md). cuDNN takes no page table with a mask aligned
to the end of each request, but the chunk's own K/V are one packed `[T, G, D]` block (as the
attention-input kernel hands them over) and the prefix part needs no mask at all. The kernel
writes the merged rows in place over cuDNN's, and its programs for requests with nothing cached
return at once, so a fresh prompt costs cuDNN's attention and little else. Branch-free: a
device-side conditional would make the host wait for the device inside the step.

Contract: `reference.paged_attention(..., mask_mode="causal")`, plus the chunk's own k and v
`[T, G, D]` (which the caller has also written into the pages). `own="cudnn"` needs
`cudnn_available`; `own="reference"` computes the same part with jnp (T x T logits: tests and
small shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import query_blocks
from pallas_kernels.paged_attention.kernel import attention_blocks, choose, extend_block_q

try:  # JAX's cuDNN attention, whose log-sum-exp stays float32 (jax.nn's is rounded to the output dtype)
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover - a jax without the cuDNN module
    _cudnn = None


def cudnn_available(dtype) -> bool:
    """Where cuDNN's part runs: half precision on a Hopper GPU or newer (the cards measured)."""
    if _cudnn is None or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    dev = jax.devices()[0]
    return dev.platform == "gpu" and float(getattr(dev, "compute_capability", "0") or 0) >= 9.0


def own_part_reference(q, k, v, cu_q_lens, *, sm_scale: float, segments: int):
    """The new tokens of requests `[0, segments)` over their own K/V, causal. q `[T, H, D]`, k / v
    `[T, G, D]`. Returns out `[T, H, D]` in q's dtype, the natural-log log-sum-exp in cuDNN's
    per-segment layout `lse [S, H, T]` float32 (`lse[seg[b], h, j]` for new token j of request b,
    -inf where no key) and `seg [B]` (-1 for requests not covered). Rows of other tokens are not
    part of the contract. Here each covered request is its own segment."""
    t, h, _ = q.shape
    batch = cu_q_lens.shape[0] - 1
    n = min(segments, batch)
    group = h // k.shape[1]
    req = query_blocks.request_of(cu_q_lens[1:], jnp.arange(t, dtype=jnp.int32))  # B: padding
    covered = req < n
    pos = jnp.arange(t)
    ok = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None]) & covered[:, None]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    # Other tokens' rows may hold anything: zeros keep NaN out of the products.
    vf = jnp.where(covered[:, None, None], jnp.repeat(v.astype(jnp.float32), group, axis=1), 0)
    logits = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kf, precision=lax.Precision.HIGHEST) * sm_scale
    logits = jnp.where(ok[None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [H, T]
    p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("hts,shd->thd", p, vf, precision=lax.Precision.HIGHEST)
    j = jnp.arange(t)
    tok = cu_q_lens[:n, None] + j[None, :]  # [S, T]: request b's token j
    inside = j[None, :] < (cu_q_lens[1:n + 1] - cu_q_lens[:n])[:, None]
    lse_seg = jnp.where(inside[:, None, :], lse[:, jnp.clip(tok, 0, t - 1)].transpose(1, 0, 2), -jnp.inf)
    seg = jnp.where(jnp.arange(batch) < n, jnp.arange(batch), -1).astype(jnp.int32)
    return out.astype(q.dtype), lse_seg, seg


def own_part_cudnn(q, k, v, cu_q_lens, *, sm_scale: float, segments: int):
    """`own_part_reference` through cuDNN: each covered request a segment of one packed sequence.

    JAX's private cuDNN entry point, because `jax.nn.dot_product_attention` takes no segments and
    rounds the log-sum-exp to the output's dtype. Segments rather than one padded sequence: cuDNN
    then skips the bucket's padding. cuDNN returns the log-sum-exp per segment `[M, H, T]`, each
    segment's tokens from index 0, segments in order of the requests with new tokens: the kernel
    reads it there, through `seg`."""
    batch = cu_q_lens.shape[0] - 1
    n = min(segments, batch)
    q_lens = cu_q_lens[1:n + 1] - cu_q_lens[:n]
    live = q_lens > 0
    segs = max(n, 2)  # one segment would be read as an unpacked batch: pad with an empty one
    seqlen = jnp.full((1, segs), -1, jnp.int32).at[0, :n].set(jnp.where(live, q_lens, -1))
    offsets = jnp.full((1, segs + 1), -1, jnp.int32).at[0, :n].set(jnp.where(live, cu_q_lens[:n], -1))
    out, stat = _cudnn.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=sm_scale, mask_type=_cudnn.MaskType.PADDING_CAUSAL, return_residual=True)
    # Rows of other tokens are whatever cuDNN left there: the kernel reads them only where seg >= 0
    # and writes zeros over padding rows.
    seg = jnp.full((batch,), -1, jnp.int32).at[:n].set(jnp.where(live, jnp.cumsum(live) - 1, -1))
    return out[0].astype(q.dtype), stat, seg


OWN_PARTS = {"cudnn": own_part_cudnn, "reference": own_part_reference}


# Requests of a chunk whose own tokens go to cuDNN; further requests take the kernel's causal
# path. cuDNN's part costs more for every segment asked for, used or not (figures: NOTES.md).
OWN_SEGMENTS = 8


def prefill_attention(q, k, v, k_pages, v_pages, page_table, seq_lens, cu_q_lens, *, sm_scale: float,
                      own: str = "cudnn", own_segments: int = OWN_SEGMENTS, interpret: bool = False):
    """Causal attention of a prompt chunk's `q [T, H, D]` over paged KV, given the chunk's own k / v
    `[T, G, D]` (already in the pages too); see the module docstring. Returns `[T, H, D]` in q's
    dtype."""
    if own not in OWN_PARTS:
        raise ValueError(f"own must be one of {sorted(OWN_PARTS)}, got {own!r}")
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    batch, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    cu = cu_q_lens.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    o_own, lse_own, seg = OWN_PARTS[own](q, k.astype(q.dtype), v.astype(q.dtype), cu, sm_scale=sm_scale,
                                         segments=own_segments)

    # The kernel's part, resumed from the own part's rows and written over them: a covered
    # request's keys below its cached prefix (none: its blocks return at once), any other
    # request's whole causal extent. Unused blocks write zeros over the padding tokens, each
    # from its q0 counted past the last request's tokens.
    covered = jnp.arange(batch) < own_segments
    stop = jnp.where(covered, seq_lens - (cu[1:] - cu[:-1]), seq_lens)
    block_q = extend_block_q(num_tokens, batch, head_dim, group)
    nb = query_blocks.max_blocks(num_tokens, batch, block_q)
    cfg = choose(num_blocks=nb, block_q=block_q, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 page_size=page_size, pages_per_seq=pages_per_seq, splits=1)
    blk_req, blk_q0 = query_blocks.plan(cu, nb, block_q)
    unused = blk_req >= batch
    blk_q0 = jnp.where(unused, (jnp.cumsum(unused) - 1) * block_q, blk_q0).astype(jnp.int32)
    out, _, _ = attention_blocks(
        q, k_pages, v_pages, page_table, seq_lens, cu, blk_req, blk_q0, jnp.zeros((1, 1, 1), jnp.int32),
        mode="causal", cfg=cfg, sm_scale=sm_scale, interpret=interpret, init=(o_own, lse_own, seg, stop),
    )
    return out
