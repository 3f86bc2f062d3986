"""Gated DeltaNet over whole sequences `[B, T, ...]` for training: causal conv and the chunked
gated delta rule, in jnp, differentiable, fresh state (no cache).

The recurrence (see `pallas_kernels/gdn/reference.py`) per value head, state S `[dk, dv]`:
    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t
with a_t = exp(g_t). A token-by-token scan is exact but serial over T. Within a chunk of C tokens
starting from state S, with G_i the in-chunk cumulative sum of g and Γ_i = exp(G_i), unrolling
gives (rows are tokens, all products batched over B, heads and chunks):
    (I + A) U = V_β - (K_β ⊙ Γ) S,           A_ij = beta_i exp(G_i - G_j) k_i·k_j  (j < i)
    O   = (Q ⊙ Γ) S + (Q K^T ⊙ M) U,          M_ij = exp(G_i - G_j)           (j <= i)
    S'  = Γ_C S + (K ⊙ exp(G_C - G))^T U
The unit lower-triangular solve does not depend on S, so it runs for all chunks at once; only
the short loop over chunks (T / C steps) carries the state. Matmuls of C x C and C x d replace
T rank-one updates: tensor-core work instead of a serial scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gdn.reference import l2_normalize

CHUNK = 64


def causal_conv1d(x, weight):
    """Depthwise causal conv + SiLU from a zero history. x `[B, T, C]`, weight `[C, K]` (oldest tap
    first) -> `[B, T, C]` in x's dtype, computed in float32 as the serving kernels do."""
    t, width = x.shape[1], weight.shape[1]
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (width - 1, 0), (0, 0)))
    w = weight.astype(jnp.float32)
    y = xp[:, 0:t, :] * w[:, 0]
    for i in range(1, width):
        y = y + xp[:, i:i + t, :] * w[:, i]
    return (y * jax.nn.sigmoid(y)).astype(x.dtype)


def _masked_exp(diff, mask):
    # exp only where the mask holds: above the diagonal G_i - G_j > 0 and could overflow, and an
    # overflow there would turn into NaN gradients even though the value is masked out.
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a `[..., C, C]`, C a power of two.

    Blockwise, doubling the block size each round: with the inverses X11, X22 of two diagonal
    blocks known, the block below them is -X22 L21 X11. Six rounds of batched matmuls for C = 64,
    exact as forward substitution and differentiable as plain jnp. (`lax.linalg.triangular_solve`
    would do too, but its gradient hangs now and then on the CPU backend of jax 0.10.)"""
    c = a.shape[-1]
    lead = a.shape[:-2]
    inv = jnp.ones(lead + (c, 1, 1), a.dtype)  # [..., blocks, size, size]: the 1 x 1 diagonal
    size = 1
    while size < c:
        n = c // (2 * size)
        blocks = jnp.diagonal(a.reshape(lead + (n, 2 * size, n, 2 * size)), axis1=-4, axis2=-2)
        l21 = jnp.moveaxis(blocks, -1, -3)[..., size:, :size]  # [..., n, size, size]
        x11, x22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        x21 = -(x22 @ l21 @ x11)
        top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=-1)
        bottom = jnp.concatenate([x21, x22], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        size *= 2
    return inv[..., 0, :, :]


def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk: int = CHUNK, scale: float | None = None,
                           use_qk_l2norm: bool = True):
    """q, k `[B, T, Hk, dk]`; v `[B, T, Hv, dv]`; g (log decay), beta `[B, T, Hv]`.

    Returns (o `[B, T, Hv, dv]` in q's dtype, final state `[B, Hv, dk, dv]` float32). Equals the
    token-by-token reference from a zero state, up to float32 rounding."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    out_dtype = q.dtype
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = dk ** -0.5 if scale is None else scale
    # Grouped values: key head i serves value heads i*r .. i*r + r - 1.
    q = jnp.repeat(q.astype(jnp.float32), hv // hk, axis=2) * scale
    k = jnp.repeat(k.astype(jnp.float32), hv // hk, axis=2)
    v, g, beta = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)

    # Pad T to whole chunks: padded tokens have beta = 0 (no write) and g = 0 (no decay), so the
    # final state is untouched; their outputs are dropped.
    if chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    c = min(chunk, 1 << (t - 1).bit_length())
    pad = -t % c
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    n = (t + pad) // c

    # [B, T, H, d] -> [B, H, N, C, d]
    def chunks(a):
        return a.reshape(b, n, c, hv, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [B, H, N, C]

    gc = jnp.cumsum(g, axis=-1)
    rows = jnp.arange(c)
    lower_incl = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    diff = gc[..., :, None] - gc[..., None, :]  # G_i - G_j  [B, H, N, C, C]

    k_beta = k * beta[..., None]
    a_mat = jnp.einsum("...id,...jd->...ij", k_beta, k) * _masked_exp(diff, strict)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(gc)[..., None]], axis=-1)
    solved = unit_lower_inverse(a_mat) @ rhs
    w, k_cum = solved[..., :dv], solved[..., dv:]  # U = w - k_cum @ S

    qk = jnp.einsum("...id,...jd->...ij", q, k) * _masked_exp(diff, lower_incl)
    q_dec = q * jnp.exp(gc)[..., None]
    g_last = gc[..., -1]  # [B, H, N]
    k_dec = k * jnp.exp(g_last[..., None] - gc)[..., None]

    def step(state, xs):
        w_n, kc_n, qk_n, qd_n, kd_n, gl_n = xs
        u = w_n - jnp.einsum("bhik,bhkv->bhiv", kc_n, state)
        o = jnp.einsum("bhik,bhkv->bhiv", qd_n, state) + jnp.einsum("bhij,bhjv->bhiv", qk_n, u)
        state = state * jnp.exp(gl_n)[..., None, None] + jnp.einsum("bhik,bhiv->bhkv", kd_n, u)
        return state, o

    per_chunk = [jnp.moveaxis(a, 2, 0) for a in (w, k_cum, qk, q_dec, k_dec, g_last)]
    state0 = jnp.zeros((b, hv, dk, dv), jnp.float32)
    state, o = jax.lax.scan(step, state0, per_chunk)  # o [N, B, H, C, dv]
    o = o.transpose(1, 0, 3, 2, 4).reshape(b, n * c, hv, dv)[:, :t]
    return o.astype(out_dtype), state
