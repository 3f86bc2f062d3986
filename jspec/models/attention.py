"""GQA self-attention over the paged KV cache (Llama, Qwen3, Qwen3-Next / Qwen3.5 gated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import ops
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.models.layers import Linear, RMSNorm
from jspec.models.rope import apply_rope
from jspec.sharding import kv_heads, split_shard_major


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, in_features: int | None = None, tp_size: int = 1):
        """in_features: width of the input x when it is not hidden_size (EAGLE3's midlayer attends
        over [embedding | hidden], 2E wide); the output is always hidden_size. tp_size: the heads
        split over that many devices (`jspec.sharding`), KV heads replicated when fewer."""
        h, d, e = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        g = kv_heads(cfg.num_key_value_heads, tp_size)
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
        self.tp_size = tp_size
        self.output_gate = cfg.attn_output_gate
        # Qwen3-Next / Qwen3.5 interleave per head [query D | gate D] in their q_proj.
        # q, k and v in one projection (HF's q_proj / k_proj / v_proj concatenated at load): one
        # weight read and one GEMM launch instead of three, which matters at decode batch sizes.
        self.q_out = h * d * (2 if self.output_gate else 1)
        e_in = e if in_features is None else in_features
        self.qkv_proj = Linear(e_in, self.q_out + 2 * g * d, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = Linear(h * d, e, bias=cfg.attention_bias, dtype=dtype)
        if cfg.qk_norm:
            kw = dict(eps=cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norm, dtype=dtype)
            self.q_norm = RMSNorm(d, **kw)
            self.k_norm = RMSNorm(d, **kw)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x, cos_sin):
        """x `[..., E]` -> q `[..., H, D]`, k and v `[..., G, D]` (normed and rotated), and the output
        gate `[..., H*D]` (None without one). The leading axes are tokens: `[T]` in the paged step,
        `[B, T]` in the dense training forward; cos / sin `[T, rotary_dim]` match the last of them."""
        lead = x.shape[:-1]
        g, d = self.num_kv_heads, self.head_dim
        q, k, v = split_shard_major(self.qkv_proj(x), [self.q_out, g * d, g * d], self.tp_size)
        q, gate = self._split_gate(q)
        k = k.reshape(*lead, g, d)
        v = v.reshape(*lead, g, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def _split_gate(self, q):
        """The q columns of the projection `[..., q_out]` -> queries `[..., H, D]` and the output gate
        `[..., H*D]` (None without one; with one, each head is [query D | gate D])."""
        lead, h, d = q.shape[:-1], self.num_heads, self.head_dim
        if not self.output_gate:
            return q.reshape(*lead, h, d), None
        q, gate = jnp.split(q.reshape(*lead, h, 2 * d), 2, axis=-1)
        return q, gate.reshape(*lead, h * d)

    def output(self, o, gate):
        """Attention output o `[..., H, D]` -> `[..., E]`: the sigmoid output gate, then o_proj."""
        o = o.reshape(*o.shape[:-2], self.num_heads * self.head_dim)
        if gate is not None:
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
        return self.o_proj(o)

    def __call__(self, x, cos_sin, kv, batch: ForwardBatch):
        """x `[T, E]` (or `[T, in_features]`); kv = (k_pages, v_pages). Returns (out `[T, E]`, new kv)."""
        tp = self.tp_size
        # norm, rotary and KV write in one kernel (ops.norm_rope_write)
        qkv = self.qkv_proj(x)
        norms = (None, None) if self.q_norm is None else (self.q_norm.weight[...], self.k_norm.weight[...])
        eps, zero_centred = (0.0, False) if self.q_norm is None else (self.q_norm.eps, self.q_norm.zero_centred)
        q, k, v, k_pages, v_pages = ops.norm_rope_write(qkv, *cos_sin, *norms, kv[0], kv[1], batch.slot_mapping,
                                                        num_heads=self.num_heads, eps=eps, zero_centred=zero_centred,
                                                        gated=self.output_gate, tp=tp)
        gate = None
        if self.output_gate:  # the kernel took the queries; the gates come from the same columns
            gate = self._split_gate(split_shard_major(qkv, [self.q_out, 2 * self.num_kv_heads * self.head_dim],
                                                      tp)[0])[1]
        scale = self.head_dim ** -0.5
        if batch.mode is ForwardMode.DECODE:
            o = ops.paged_decode(q, k_pages, v_pages, batch.page_table, batch.seq_lens, sm_scale=scale, tp=tp)
        elif batch.mode is ForwardMode.VERIFY and batch.tree_mask is not None:
            o = ops.paged_attention(q, k_pages, v_pages, batch.page_table, batch.seq_lens, batch.cu_q_lens,
                                    sm_scale=scale, mask_mode="tree", custom_mask=batch.tree_mask, tp=tp)
        elif batch.mode is ForwardMode.EXTEND:  # prompt chunks
            o = ops.extend_attention(q, k, v, k_pages, v_pages, batch.page_table, batch.seq_lens, batch.cu_q_lens,
                                     sm_scale=scale, tp=tp)
        else:  # chain verify (a chain is the causal case)
            o = ops.paged_attention(
                q, k_pages, v_pages, batch.page_table, batch.seq_lens, batch.cu_q_lens, sm_scale=scale, tp=tp
            )
        return self.output(o, gate), (k_pages, v_pages)
