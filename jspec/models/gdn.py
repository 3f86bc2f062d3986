"""Gated DeltaNet token mixer (Qwen3-Next fused projections, Qwen3.5 split projections).

The conv window and recurrent state live in the state pool (`Caches.conv`, `Caches.ssm`), one slot
per request; the kernels behind `ops` read a request's slot and write its new state back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import ops
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.models.layers import GatedRMSNorm, Linear, _param
from jspec.sharding import concat_shard_major, split_shard_major


class DepthwiseConv(nnx.Module):
    """Holds the causal conv's weight in HF's Conv1d layout `[C, 1, K]`; the kernel applies it."""

    def __init__(self, channels: int, width: int, *, dtype):
        self.weight = _param((channels, 1, width), dtype)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, tp_size: int = 1):
        """tp_size: key and value heads (and the conv channels and state pool with them) split over
        that many devices; the conv channels [q | k | v] are then shard-major (`jspec.sharding`)."""
        e = cfg.hidden_size
        self.tp_size = tp_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.fused = cfg.gdn_fused_projections
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * key_dim + value_dim
        if self.fused:
            # Qwen3-Next: outputs grouped by key head, [q dk | k dk | v r*dv | z r*dv] and [b r | a r].
            self.in_proj_qkvz = Linear(e, 2 * key_dim + 2 * value_dim, bias=False, dtype=dtype)
            self.in_proj_ba = Linear(e, 2 * self.hv, bias=False, dtype=dtype)
        else:
            self.in_proj_qkv = Linear(e, conv_dim, bias=False, dtype=dtype)
            self.in_proj_z = Linear(e, value_dim, bias=False, dtype=dtype)
            self.in_proj_b = Linear(e, self.hv, bias=False, dtype=dtype)
            self.in_proj_a = Linear(e, self.hv, bias=False, dtype=dtype)
        self.conv1d = DepthwiseConv(conv_dim, cfg.linear_conv_kernel_dim, dtype=dtype)
        self.dt_bias = _param((self.hv,), dtype, 1.0)
        self.A_log = _param((self.hv,), dtype)
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(value_dim, e, bias=False, dtype=dtype)

    def project(self, x):
        """x `[..., E]` -> mixed qkv `[..., C]` (conv input, [q | k | v] flat), z `[..., Hv, dv]`, b, a
        `[..., Hv]`. The leading axes are tokens: `[T]` in the paged step, `[B, T]` in training."""
        lead = x.shape[:-1]
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        if self.fused:
            r = hv // hk
            qkvz = self.in_proj_qkvz(x).reshape(*lead, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
            ba = self.in_proj_ba(x).reshape(*lead, hk, 2 * r)
            b, a = jnp.split(ba, 2, axis=-1)
            mixed = concat_shard_major([q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)],
                                       self.tp_size)
            return mixed, z.reshape(*lead, hv, dv), b.reshape(*lead, hv), a.reshape(*lead, hv)
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(*lead, hv, dv)
        return mixed, z, self.in_proj_b(x), self.in_proj_a(x)

    def gates(self, b, a):
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        return g, beta

    def split_heads(self, mixed):
        lead = mixed.shape[:-1]
        key_dim = self.hk * self.dk
        q, k, v = split_shard_major(mixed, [key_dim, key_dim, self.hv * self.dv], self.tp_size)
        return (q.reshape(*lead, self.hk, self.dk), k.reshape(*lead, self.hk, self.dk),
                v.reshape(*lead, self.hv, self.dv))

    def conv_weight(self):
        """The causal conv's weight as `[C, K]` (oldest tap first)."""
        return self.conv1d.weight[...][:, 0, :]

    def finish(self, core, z, dtype):
        """Core output `[..., Hv, dv]` -> `[..., E]`: gated RMSNorm with z, then out_proj."""
        out = self.norm(core.astype(dtype), z)
        return self.out_proj(out.reshape(*out.shape[:-2], self.hv * self.dv))

    def __call__(self, x, conv_pool, ssm_pool, batch: ForwardBatch):
        """x `[T, E]` -> (out `[T, E]`, conv, ssm).

        conv / ssm are the updated pools, except in verify mode, where the pools must survive a
        rejection: then conv is the window after every draft token `[B, N, C, K-1]` and ssm is
        what `ops.gdn_commit` replays over the committed state for the accepted path: the draft
        tokens' (k, v, g, beta) as the recurrence takes them."""
        mixed, z, b, a = self.project(x)
        weight = self.conv_weight()
        verify = batch.mode is ForwardMode.VERIFY
        tp = self.tp_size
        if verify:
            mixed, conv = ops.causal_conv1d_verify(mixed, weight, conv_pool, batch.state_slots, batch.parents, tp=tp)
        else:
            conv_in = mixed
            mixed, conv = ops.causal_conv1d(
                mixed, weight, conv_pool, batch.cu_q_lens, batch.state_slots, batch.has_initial_state, tp=tp
            )
        snapshots = batch.snapshot_rows is not None and batch.mode is ForwardMode.EXTEND
        save_rows = None
        if snapshots:  # prefix-cache snapshots inside the chunk: conv windows here, states in the kernel
            conv = ops.save_conv_windows(conv, conv_in, batch.snapshot_tokens, batch.snapshot_rows, tp=tp)
            t = x.shape[0]
            at = jnp.where(batch.snapshot_rows >= 0, batch.snapshot_tokens, t)
            save_rows = jnp.full((t,), -1, jnp.int32).at[at].set(batch.snapshot_rows, mode="drop")
        q, k, v = self.split_heads(mixed)
        g, beta = self.gates(b, a)
        if verify:
            core = ops.gated_delta_rule_verify(q, k, v, g, beta, ssm_pool, batch.state_slots, batch.parents, tp=tp)
            ssm = (k, v, g, beta)
        else:
            core, ssm = ops.gated_delta_rule(
                q, k, v, g, beta, ssm_pool, batch.cu_q_lens, batch.state_slots, batch.has_initial_state,
                decode=batch.mode is ForwardMode.DECODE, tp=tp, save_rows=save_rows,
            )
        return self.finish(core, z, x.dtype), conv, ssm
