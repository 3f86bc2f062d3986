"""Basic Flax NNX layers with Hugging Face parameter names and layouts.

Weights keep HF's `[out, in]` layout, so loading is a view of the safetensors file and the matmul
contracts on the weight's last axis (cuBLAS takes the transposed operand for free).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models import ops
from pallas_kernels.rms_norm import reference as norm_ref


def _param(shape, dtype, fill=0.0):
    return nnx.Param(jnp.full(shape, fill, dtype))


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.weight = _param((out_features, in_features), dtype)
        self.bias = _param((out_features,), dtype) if bias else None

    def __call__(self, x):
        w = self.weight[...]
        y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    def __init__(self, num_embeddings: int, features: int, *, dtype, tp_size: int = 1):
        """tp_size: the rows (vocabulary) are split that many ways (`ops.vocab_embed`)."""
        self.weight = _param((num_embeddings, features), dtype)
        self.tp_size = tp_size

    def __call__(self, ids):
        """ids `[T]` -> `[T, E]`."""
        return ops.vocab_embed(self.weight[...], ids, tp=self.tp_size)

    def attend(self, x):
        """Tied lm_head: logits = x @ E^T."""
        return jax.lax.dot_general(x, self.weight[...], (((x.ndim - 1,), (1,)), ((), ())))


class RMSNorm(nnx.Module):
    """RMSNorm in float32. `zero_centred`: the weight is stored as w - 1 and applied as (1 + w)
    (Qwen3-Next / Qwen3.5), and the product is taken before casting back, as those models do;
    Llama / Qwen3 cast the normalised input first and then scale."""

    def __init__(self, dim: int, *, eps: float, zero_centred: bool, dtype):
        self.weight = _param((dim,), dtype, 0.0 if zero_centred else 1.0)
        self.eps = eps
        self.zero_centred = zero_centred

    def __call__(self, x):
        return norm_ref.rms_norm(x, self.weight[...], eps=self.eps, zero_centred=self.zero_centred)


class GatedRMSNorm(nnx.Module):
    """Gated DeltaNet output norm: RMSNorm over dv (plain weight), then times silu(z) in float32."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = _param((dim,), dtype, 1.0)
        self.eps = eps

    def __call__(self, x, z):
        dtype = x.dtype
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * xf.astype(dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
