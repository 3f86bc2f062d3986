"""The oracle of `pallas_kernels.rms_norm`: the residual add and RMSNorm as jspec's decoder layers
compute them step by step."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, *, eps: float, zero_centred: bool):
    """RMSNorm over the last axis in float32, as jspec's `RMSNorm` rounds it: Llama / Qwen3 round the
    normalised input to x's dtype and then scale; zero-centred weights (Qwen3-Next) scale by 1 + w
    and round once."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centred:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def add_rms_norm(x, delta, weight, *, eps: float, zero_centred: bool):
    """x + delta `[T, E]` (delta None: x itself; the new residual stream) and its RMSNorm by weight
    `[E]` (`rms_norm`). Returns (residual, normed)."""
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps=eps, zero_centred=zero_centred)
