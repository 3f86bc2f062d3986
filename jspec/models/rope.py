"""Rotary position embedding (HF's rotate-half convention), full or partial, default or llama3-scaled."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jspec.config import RopeConfig


def rope_cos_sin(rope: RopeConfig, positions):
    """positions `[T]` -> (cos, sin) `[T, rotary_dim]` in float32."""
    inv_freq = jnp.asarray(rope.inv_freq().astype(np.float32))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x `[T, heads, D]`: rotate the leading rotary_dim channels, pass the rest through."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    xf = x_rot.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    out = out.astype(x.dtype)
    if x_pass.shape[-1] == 0:
        return out
    return jnp.concatenate([out, x_pass], axis=-1)
