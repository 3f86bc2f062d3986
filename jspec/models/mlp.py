"""Feed-forward blocks: SwiGLU MLP and the sparse MoE block (top-k router, optional shared expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.config import ModelConfig
from jspec.models import ops
from jspec.models.layers import Linear, _param
from jspec.sharding import split_shard_major


class MLP(nnx.Module):
    """SwiGLU. gate_proj and up_proj are one `gate_up_proj` (HF's two concatenated at load;
    shard-major at tp_size > 1, see `jspec.sharding`)."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False, dtype, tp_size: int = 1):
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, bias=bias, dtype=dtype)
        self.intermediate, self.tp_size = intermediate, tp_size

    def __call__(self, x):
        gate, up = split_shard_major(self.gate_up_proj(x), [self.intermediate] * 2, self.tp_size)
        return self.down_proj(jax.nn.silu(gate) * up)


class Router(nnx.Module):
    def __init__(self, hidden: int, num_experts: int, *, dtype):
        self.weight = _param((num_experts, hidden), dtype)


class Experts(nnx.Module):
    """All experts' weights stacked as `[X, in, out]`: gate_up_proj `[X, E, 2I]` (gate columns
    first), down_proj `[X, I, E]`. This is the transpose of HF's fused `[X, out, in]`: XLA's grouped
    GEMM wants the contracted axis second, and would otherwise transpose every expert every step
    (pallas_kernels/moe/NOTES.md has the measurement)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, dtype):
        self.gate_up_proj = _param((num_experts, hidden, 2 * intermediate), dtype)
        self.down_proj = _param((num_experts, intermediate, hidden), dtype)


# Token counts up to which SparseMoE runs the expert-tiled gather kernels (`ops.moe_gather`) rather
# than the grouped GEMM (`ragged_dot`): XLA's ragged_dot computes far more than the routed rows, so
# its time grows about linearly with T, while the tiled kernels read each expert once per tile of
# its pairs and grow sublinearly. Measured from 1 to 512 tokens they win by a growing margin from a
# few tokens on (at a single token the two are close), and the bound extends that trend to a usual
# largest prefill chunk (pallas_kernels/moe/NOTES.md). A static Python int: each token bucket
# compiles one path.
GATHER_MAX_TOKENS = 8192


def _grouped_matmul(x, w, group_sizes):
    """Rows of x `[M, in]` sorted by expert, w `[X, in, out]` -> `[M, out]` (one grouped GEMM)."""
    return jax.lax.ragged_dot(x, w, group_sizes)


class SparseMoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, tp_size: int = 1, expert_parallel: bool = False):
        """tp_size: each expert's intermediate dimension split over that many devices, or with
        expert_parallel the experts themselves (X / tp whole experts per device)."""
        e = cfg.hidden_size
        self.tp_size = tp_size
        self.expert_parallel = expert_parallel
        # The experts' gate_up columns are shard-major only when their intermediate dimension is split.
        self.expert_layout_tp = 1 if expert_parallel else tp_size
        self.intermediate = cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Router(e, cfg.num_experts, dtype=dtype)
        self.experts = Experts(cfg.num_experts, e, cfg.moe_intermediate_size, dtype=dtype)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(e, cfg.shared_expert_intermediate_size, dtype=dtype, tp_size=tp_size)
            self.shared_expert_gate = Linear(e, 1, bias=False, dtype=dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x):
        """Router over x `[..., E]`: (weights `[..., K]` in x's dtype, expert ids `[..., K]`), from a
        float32 softmax, renormalised over the top k when the config says so."""
        logits = jax.lax.dot_general(x, self.gate.weight[...], (((x.ndim - 1,), (1,)), ((), ())))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights.astype(x.dtype), experts

    def add_shared(self, x, routed):
        """routed + the sigmoid-gated shared expert of x (when the model has one)."""
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x)
        return routed + jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32)).astype(x.dtype) * shared

    def __call__(self, x):
        t = x.shape[0]
        weights, experts = self.route(x)  # [T, K]
        if t <= GATHER_MAX_TOKENS:
            out = self._routed_gather(x, experts, weights)
        else:
            out = self._routed_grouped(x, experts, weights)
        return self.add_shared(x, out)

    def all_experts(self, x):
        """The same block for training over x `[..., E]`: every expert runs on every token and the
        router's top-k weights (zero elsewhere) combine them. X times the routed FLOPs, but no sort
        and no scatter, which is the better trade for a handful of small experts."""
        weights, experts = self.route(x)
        combine = jnp.sum(jax.nn.one_hot(experts, self.num_experts, dtype=x.dtype) * weights[..., None], axis=-2)
        gate_up = jnp.einsum("...e,xef->...xf", x, self.experts.gate_up_proj[...])
        gate, up = split_shard_major(gate_up, [self.intermediate] * 2, self.expert_layout_tp)
        down = jnp.einsum("...xi,xie->...xe", jax.nn.silu(gate) * up, self.experts.down_proj[...])
        routed = jnp.einsum("...xe,...x->...e", down, combine, preferred_element_type=jnp.float32)
        return self.add_shared(x, routed.astype(x.dtype))

    def _routed_gather(self, x, experts, weights):
        """Decode and verify batches: the expert-tiled gather kernels stream each routed expert's
        weights about once per tile of up to 16 of its (token, expert) pairs.

        XLA lowers `ragged_dot` on GPU to a dense product over every expert, which at these sizes
        reads all X experts to use at most T*K of them; XLA's own gather + GEMV fusion reaches a
        fraction of the memory bandwidth. On CPU `ops.moe_gather` runs the jnp reference."""
        return ops.moe_gather(x, experts, weights, self.experts.gate_up_proj[...], self.experts.down_proj[...],
                              tp=self.tp_size, expert_parallel=self.expert_parallel)

    def _routed_grouped(self, x, experts, weights):
        """Many tokens (prefill): one grouped GEMM over tokens sorted by expert."""
        t, e = x.shape
        k = self.top_k
        # Sort the T*K (token, expert) pairs by expert so each expert's rows are contiguous.
        flat_experts = experts.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        rows = x[order // k]
        group_sizes = jnp.bincount(flat_experts, length=self.num_experts).astype(jnp.int32)
        gate_up = _grouped_matmul(rows, self.experts.gate_up_proj[...], group_sizes)
        gate, up = split_shard_major(gate_up, [self.intermediate] * 2, self.expert_layout_tp)
        hidden = jax.nn.silu(gate) * up
        down = _grouped_matmul(hidden, self.experts.down_proj[...], group_sizes)  # [T*K, E]
        down = down * weights.reshape(-1)[order][:, None]
        return jnp.zeros((t, e), jnp.float32).at[order // k].add(down.astype(jnp.float32)).astype(x.dtype)
