"""The oracle of the skinny matmul: y `[M, N]` = x `[M, K]` @ w `[N, K]`.T, accumulated in float32
and rounded once to x's dtype, as `jspec.models.layers.Linear` computes it through XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def skinny_matmul(x, w):
    y = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
