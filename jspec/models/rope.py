"""Rotary position embedding (HF's rotate-half convention), full or partial, default or llama3-scaled."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jspec.config import RopeConfig
from pallas_kernels.paged_attention import reference as attn_ref


def rope_cos_sin(rope: RopeConfig, positions):
    """positions `[T]` -> (cos, sin) `[T, rotary_dim]` in float32."""
    inv_freq = jnp.asarray(rope.inv_freq().astype(np.float32))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x `[T, heads, D]`: rotate the leading rotary_dim channels, pass the rest through (the same
    rounding as the fused attention-input kernel's reference, which owns the formula)."""
    return attn_ref.rope(x, cos, sin)
