"""The oracle of `pallas_kernels.rms_norm`: the residual add and RMSNorm as jspec's decoder layers
compute them step by step."""

from __future__ import annotations

from pallas_kernels.paged_attention.reference import rms_norm


def add_rms_norm(x, delta, weight, *, eps: float, zero_centred: bool):
    """x + delta `[T, E]` (delta None: x itself; the new residual stream) and its RMSNorm by weight
    `[E]` (`paged_attention.reference.rms_norm`). Returns (residual, normed)."""
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps=eps, zero_centred=zero_centred)
