"""Causal attention of a prompt chunk in two parts: the chunk's new tokens over themselves through
cuDNN's flash attention, then over the request's cached prefix through this package's kernel,
which starts its online softmax from cuDNN's rows and log-sum-exp.

Why two parts: a long chunk's T x T causal block is compute-bound, and there cuDNN's Hopper kernel
outruns what the Triton lowering reaches (NOTES.md). cuDNN takes no page table with a mask aligned
to the end of the request, but the chunk's own K/V are one `[T, G, D]` block (gathered back from
the slots just written) and the prefix part needs no mask at all. The kernel writes the merged
rows, so nothing is merged in a pass of its own. Only a chunk of one request takes this path: for
several requests in one chunk the kernel alone was faster (NOTES.md).

Contract: `reference.paged_attention(..., mask_mode="causal")`, plus `slot_mapping [T]` (where each
new token's K/V were written; -1 for padding tokens). `own="cudnn"` needs `cudnn_available`;
`own="reference"` computes the same part with jnp (T x T logits: tests and small shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import query_blocks
from pallas_kernels.paged_attention.attention import paged_attention
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


def _token_segments(cu_q_lens, num_tokens: int):
    """Per token: its request `[T]` (B for padding), index among the request's new tokens `[T]`."""
    batch = cu_q_lens.shape[0] - 1
    req = query_blocks.request_of(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32))
    j = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[jnp.minimum(req, batch - 1)]
    return req, j


def own_part_reference(q, k, v, cu_q_lens, *, sm_scale: float):
    """Each request's new tokens over their own K/V, causal. q `[T, H, D]`, k / v `[T, G, D]`.
    Returns (out `[T, H, D]` in q's dtype, lse `[T, H]` float32 natural log, -inf where no key)."""
    t, h, _ = q.shape
    group = h // k.shape[1]
    req, _ = _token_segments(cu_q_lens, t)
    pos = jnp.arange(t)
    ok = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None]) & (req[:, None] < cu_q_lens.shape[0] - 1)
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)
    logits = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kf, precision=lax.Precision.HIGHEST) * sm_scale
    logits = jnp.where(ok[None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [H, T]
    p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("hts,shd->thd", p, vf, precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype), lse.T


def own_part_cudnn(q, k, v, cu_q_lens, *, sm_scale: float):
    """`own_part_reference` through cuDNN for a chunk whose new tokens all belong to request 0 (the
    chunk `prefill_attention` sends here); tokens past them get zeros and lse -inf.

    JAX's private cuDNN entry point, because `jax.nn.dot_product_attention` rounds the log-sum-exp
    to the output's dtype, too coarse to merge by. Packed sequences (one segment per request) ran
    slower than the kernel alone at every shape measured, so several requests never come here."""
    t = q.shape[0]
    n = cu_q_lens[1:2] - cu_q_lens[:1]  # [1]
    out, stat = _cudnn.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=n, kv_seqlen=n, scale=sm_scale,
        mask_type=_cudnn.MaskType.PADDING_CAUSAL, return_residual=True)  # stat [1, H, T], float32
    valid = jnp.arange(t) < n[0]
    lse = jnp.where(valid[:, None], stat[0].T, -jnp.inf)
    return jnp.where(valid[:, None, None], out[0], 0).astype(q.dtype), lse


OWN_PARTS = {"cudnn": own_part_cudnn, "reference": own_part_reference}


def prefill_attention(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, slot_mapping, *, sm_scale: float,
                      own: str = "cudnn", interpret: bool = False):
    """Causal attention of a prompt chunk's `q [T, H, D]` over paged KV (its own K/V already in the
    pages at `slot_mapping`). A chunk of one request runs in two parts (the module docstring), the
    prefix part only where something is cached; a chunk of several requests runs the kernel alone
    (`attention.paged_attention`). Returns `[T, H, D]` in q's dtype."""
    if own not in OWN_PARTS:
        raise ValueError(f"own must be one of {sorted(OWN_PARTS)}, got {own!r}")
    cu = cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    one_request = jnp.sum(q_lens > 0) == 1
    args = (q, k_pages, v_pages, page_table, seq_lens.astype(jnp.int32), cu)
    return lax.cond(
        one_request & (q_lens[0] > 0),
        lambda a: _one_request(*a, slot_mapping, sm_scale=sm_scale, own=own, interpret=interpret),
        lambda a: paged_attention(*a, sm_scale=sm_scale, interpret=interpret),
        args,
    )


def _one_request(q, k_pages, v_pages, page_table, seq_lens, cu, slot_mapping, *, sm_scale, own, interpret):
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    batch, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    # Padding tokens (slot -1) read slot 0, which may hold anything: zeros keep NaN out of products.
    written = (slot_mapping >= 0)[:, None, None]
    slots = jnp.clip(slot_mapping, 0, flat[0] - 1)
    k_new = jnp.where(written, k_pages.reshape(flat)[slots], 0)
    v_new = jnp.where(written, v_pages.reshape(flat)[slots], 0)
    o_own, lse_own = OWN_PARTS[own](q, k_new, v_new, cu, sm_scale=sm_scale)

    def with_prefix(o_own, lse_own):
        prefix_lens = jnp.maximum(seq_lens - (cu[1:] - cu[:-1]), 0)
        block_q = extend_block_q(num_tokens, batch, head_dim, group)
        nb = query_blocks.max_blocks(num_tokens, batch, block_q)
        cfg = choose(num_blocks=nb, block_q=block_q, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size, pages_per_seq=pages_per_seq, splits=1)
        blk_req, blk_q0 = query_blocks.plan(cu, nb, block_q)
        rows, _, _ = attention_blocks(
            q, k_pages, v_pages, page_table, prefix_lens, cu, blk_req, blk_q0, jnp.zeros((1, 1, 1), jnp.int32),
            mode="full", cfg=cfg, sm_scale=sm_scale, interpret=interpret, init=(o_own, lse_own),
        )
        return query_blocks.gather_rows(rows[:, :, 0], cu, num_tokens, block_q, group)

    cached = seq_lens[0] > cu[1]
    return lax.cond(cached, with_prefix, lambda o, _: o, o_own, lse_own)
