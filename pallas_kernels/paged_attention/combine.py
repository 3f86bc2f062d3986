"""Merge flash-decoding partials across KV splits.

Split s of a row left (acc_s, m_s, l_s) with acc_s = sum_j 2^(x_j - m_s) v_j and l_s the same sum
without v, in the log2 domain. Rescaling every split to the common max M gives
out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. A split that saw nothing has m_s = -inf and
weight 0; a row that saw nothing anywhere gets 0 (not 0/0). The arrays are tiny next to the KV the
kernel read (S x rows x D floats per program), so this stays in jnp and XLA fuses it.
"""

from __future__ import annotations

import jax.numpy as jnp


def combine_splits(acc, m, l, dtype):
    """acc `[NB, G, S, M, D]`, m and l `[NB, G, S, M]` -> `[NB, G, M, D]` in `dtype`."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp2(m - m_all)  # [NB, G, S, M]
    num = jnp.sum(w[..., None] * acc, axis=2)
    den = jnp.sum(w * l, axis=2)
    return (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(dtype)
