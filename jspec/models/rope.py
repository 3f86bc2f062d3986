"""Rotary position embedding (HF's rotate-half convention), full or partial, default or llama3-scaled."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jspec.config import RopeConfig
from pallas_kernels.paged_attention import reference as attn_ref


def inv_freq(rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies `[rotary_dim // 2]` in float64 (cast by the caller). llama3 scaling
    divides the low frequencies by `factor` and blends smoothly between the two wavelength bounds."""
    dim = rope.rotary_dim
    inv = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope.scaling == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(rope: RopeConfig, positions):
    """positions `[T]` -> (cos, sin) `[T, rotary_dim]` in float32."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq(rope).astype(np.float32))[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x `[T, heads, D]`: rotate the leading rotary_dim channels, pass the rest through (the same
    rounding as the fused attention-input kernel's reference, which owns the formula)."""
    return attn_ref.rope(x, cos, sin)
