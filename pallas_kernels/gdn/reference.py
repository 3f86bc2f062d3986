"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in pure jnp: oracle and CPU path.

Per request slot the state pool holds a conv window `[C, K-1]` (the last K-1 inputs of the
depthwise causal conv, oldest first) and a recurrent state `[Hv, dk, dv]` in float32.

Recurrence for one token and value head h (key head h // (Hv / Hk)), with q, k L2-normalised and
q scaled by `scale` (dk ** -0.5 by default):
    S <- S * exp(g);  delta = beta * (v - k^T S);  S <- S + k delta^T;  o = q^T S

Ragged layout as in paged attention: request b owns tokens `cu_seqlens[b] : cu_seqlens[b+1]`, reads
its initial state from pool slot `slots[b]` when `has_initial[b]` (else zeros) and writes its final
state back there. Tokens past `cu_seqlens[B]` are padding: zero output, no state written.

Verification never touches the pool: `*_verify` start each draft token from its parent's state
(`parents[b, j]`, -1 = the committed state in the slot; parents come before children). The conv
returns the window after every draft token as scratch; the recurrent state does not (one state per
draft token would be N x 64 KiB per head to write and read back). Instead `commit` replays the
accepted path's tokens on the committed state and copies the accepted node's conv window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import token_request_index


def l2_normalize(x, eps: float = 1e-6):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _expand_heads(x, num_v_heads):
    """Grouped-value attention: key head i serves value heads i*r .. i*r + r - 1."""
    return jnp.repeat(x, num_v_heads // x.shape[-2], axis=-2)


# --------------------------------------------------------------------------------------------
# Causal depthwise conv1d + SiLU
# --------------------------------------------------------------------------------------------


def _conv_out(window, weight):
    """window `[..., C, K]` (oldest first, current token last), weight `[C, K]` -> SiLU output `[..., C]`."""
    y = jnp.sum(window.astype(jnp.float32) * weight.astype(jnp.float32), axis=-1)
    return y * jax.nn.sigmoid(y)


def causal_conv1d(x, weight, conv_pool, cu_seqlens, slots, has_initial):
    """Ragged causal conv over new tokens, continuing each request's window in the pool.

    x: `[T, C]`; weight: `[C, K]`; conv_pool: `[S, C, K-1]`; cu_seqlens: `[B+1]`; slots: `[B]`;
    has_initial: `[B]` bool. Returns (y `[T, C]` in x's dtype, updated conv_pool).
    """
    num_tokens, channels = x.shape
    width = weight.shape[1]
    batch = slots.shape[0]
    req = token_request_index(cu_seqlens, num_tokens)
    valid = req < batch
    req_c = jnp.minimum(req, batch - 1)
    start = cu_seqlens[req_c]
    t = jnp.arange(num_tokens, dtype=jnp.int32)

    init = conv_pool[slots].astype(x.dtype)  # [B, C, K-1]
    init = jnp.where(has_initial[:, None, None], init, 0)

    # Column i of token t's window holds input t - (K-1) + i: from this step when at or after the
    # request's first new token, else from the slot's stored window.
    cols = []
    for i in range(width):
        src = t - (width - 1) + i
        from_step = src >= start
        cur = x[jnp.clip(src, 0, num_tokens - 1)]
        hist_col = jnp.clip((width - 1) + (src - start), 0, width - 2)  # index into init window
        hist = init[req_c, :, hist_col]  # [T, C]
        cols.append(jnp.where(from_step[:, None], cur, hist))
    window = jnp.stack(cols, axis=-1)  # [T, C, K]
    y = _conv_out(window, weight)
    y = jnp.where(valid[:, None], y, 0).astype(x.dtype)

    # New window of request b: the K-1 inputs before its end, i.e. the window of its last token
    # shifted by one (current token included, oldest dropped).
    end = cu_seqlens[1:]
    last = jnp.clip(end - 1, 0, num_tokens - 1)
    new_win = window[last][:, :, 1:]  # [B, C, K-1]
    has_tokens = end > cu_seqlens[:-1]
    # Route requests without new tokens out of bounds so nothing is written for them.
    target = jnp.where(has_tokens, slots, conv_pool.shape[0])
    conv_pool = conv_pool.at[target].set(new_win.astype(conv_pool.dtype), mode="drop")
    return y, conv_pool


def save_conv_windows(conv_pool, x, tokens, rows):
    """Conv windows of prefix-cache snapshots inside a prompt chunk: conv_pool[rows[i]] becomes the
    window after token tokens[i] of x `[T, C]` (its K-1 inputs up to and including it), as
    `causal_conv1d` leaves a request that ends there. tokens / rows `[S]` int32, rows -1 = none; each
    token at least K-2 tokens into its request's part of x (snapshots sit at 64-token chunk ends)."""
    if rows.shape[0] == 0:
        return conv_pool
    width = conv_pool.shape[-1]  # K - 1
    num_tokens = x.shape[0]
    src = tokens[:, None] - (width - 1) + jnp.arange(width)[None, :]  # [S, K-1], oldest first
    window = jnp.swapaxes(x[jnp.clip(src, 0, num_tokens - 1)], 1, 2)  # [S, C, K-1]
    target = jnp.where(rows >= 0, rows, conv_pool.shape[0])
    return conv_pool.at[target].set(window.astype(conv_pool.dtype), mode="drop")


def causal_conv1d_verify(x, weight, conv_pool, slots, parents):
    """Draft-token conv: x `[B*N, C]`; parents `[B, N]` (-1 = committed window).

    Returns (y `[B*N, C]`, conv_scratch `[B, N, C, K-1]` = the window after each draft token).
    """
    batch, n = parents.shape
    channels = x.shape[1]
    xb = x.reshape(batch, n, channels)
    windows = [conv_pool[slots].astype(x.dtype)]  # index 0: committed; j + 1: after token j
    outs = []
    for j in range(n):
        stacked = jnp.stack(windows, axis=1)  # [B, j+1, C, K-1]
        prev = jnp.take_along_axis(stacked, (parents[:, j] + 1)[:, None, None, None], axis=1)[:, 0]
        full = jnp.concatenate([prev, xb[:, j, :, None]], axis=-1)  # [B, C, K]
        outs.append(_conv_out(full, weight))
        windows.append(full[:, :, 1:])
    y = jnp.stack(outs, axis=1).reshape(batch * n, channels).astype(x.dtype)
    scratch = jnp.stack(windows[1:], axis=1).astype(conv_pool.dtype)
    return y, scratch


# --------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------


def _prep(q, k, v, g, beta, scale, use_qk_l2norm):
    num_v_heads = v.shape[-2]
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q = _expand_heads(q.astype(jnp.float32), num_v_heads) * scale
    k = _expand_heads(k.astype(jnp.float32), num_v_heads)
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)


def _step(state, q, k, v, g, beta):
    """One token for every value head: state `[..., Hv, dk, dv]`, q/k `[..., Hv, dk]`, v `[..., Hv, dv]`."""
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("...hkv,...hk->...hv", state, k)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.einsum("...hkv,...hk->...hv", state, q)
    return state, out


def gated_delta_rule(
    q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial, *, scale=None, use_qk_l2norm=True,
    save_rows=None,
):
    """Ragged prefill / decode over T tokens, continuing each request's state in the pool.

    q, k: `[T, Hk, dk]`; v: `[T, Hv, dv]`; g (log decay), beta: `[T, Hv]`;
    state_pool: `[S, Hv, dk, dv]` float32. Returns (o `[T, Hv, dv]` in q's dtype, state_pool).
    save_rows `[T]` int32 (optional, -1 = none): the state after token t also goes to pool row
    save_rows[t] (a prefix-cache snapshot inside a prompt chunk). The chunked kernel takes such rows
    only at the ends of its 64-token chunks of each request.
    """
    num_tokens = q.shape[0]
    batch = slots.shape[0]
    out_dtype = q.dtype
    qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    req = token_request_index(cu_seqlens, num_tokens)
    valid = req < batch
    req_c = jnp.minimum(req, batch - 1)
    first = jnp.arange(num_tokens) == cu_seqlens[req_c]
    slot = slots[req_c]
    fresh = first & ~has_initial[req_c]
    oob = state_pool.shape[0]

    # Token by token, carrying the whole pool: exact and simple, fine for an oracle.
    def body(pool, xs):
        qt, kt, vt, gt, bt, s, is_valid, is_fresh, *sv = xs
        state = jnp.where(is_fresh, 0.0, pool[s])
        state, out = _step(state, qt, kt, vt, gt, bt)
        pool = pool.at[jnp.where(is_valid, s, oob)].set(state, mode="drop")
        if sv:  # a snapshot row after this token
            pool = pool.at[jnp.where(is_valid & (sv[0] >= 0), sv[0], oob)].set(state, mode="drop")
        return pool, out

    saves = () if save_rows is None else (save_rows.astype(jnp.int32),)
    pool, out = jax.lax.scan(body, state_pool, (qf, kf, vf, gf, bf, slot, valid, fresh, *saves))
    out = jnp.where(valid[:, None, None], out, 0)
    return out.astype(out_dtype), pool


def ancestors(parents):
    """`[B, N]` parents (-1 = root, parents before children) -> `[B, N, N]` bool: `[b, j, i]` is
    True when node i lies on the path from the committed state to node j, j itself included. Since
    a parent's index is smaller than its child's, the path in index order is the path root first."""
    batch, n = parents.shape
    anc = jnp.zeros((batch, n, n), bool)
    eye = jnp.eye(n, dtype=bool)
    rows = jnp.arange(batch)
    for j in range(n):
        p = parents[:, j]
        from_parent = jnp.where((p >= 0)[:, None], anc[rows, jnp.maximum(p, 0)], False)
        anc = anc.at[:, j].set(from_parent | eye[j])
    return anc


def gated_delta_rule_verify(q, k, v, g, beta, state_pool, slots, parents, *, scale=None, use_qk_l2norm=True):
    """Draft tokens `[B*N, ...]` each from its parent's state; the pool is read, never written.

    Returns o `[B*N, Hv, dv]`. The states after each token are not returned: `commit` replays.
    """
    batch, n = parents.shape
    out_dtype = q.dtype
    qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    shape = lambda a: a.reshape((batch, n) + a.shape[1:])  # noqa: E731
    qf, kf, vf, gf, bf = map(shape, (qf, kf, vf, gf, bf))
    states = [state_pool[slots]]
    outs = []
    for j in range(n):
        stacked = jnp.stack(states, axis=1)
        prev = jnp.take_along_axis(stacked, (parents[:, j] + 1)[:, None, None, None, None], axis=1)[:, 0]
        st, o = _step(prev, qf[:, j], kf[:, j], vf[:, j], gf[:, j], bf[:, j])
        states.append(st)
        outs.append(o)
    out = jnp.stack(outs, axis=1).reshape((batch * n,) + outs[0].shape[1:])
    return out.astype(out_dtype)


def accepted_path(parents, accepted):
    """`[B, N]` bool: the nodes whose tokens lead from the committed state to node `accepted[b]`
    (its ancestors and itself); all False where accepted is negative."""
    n = parents.shape[1]
    rows = jnp.arange(parents.shape[0])
    return ancestors(parents)[rows, jnp.clip(accepted, 0, n - 1)] & (accepted >= 0)[:, None]


def commit(state_pool, conv_pool, conv_scratch, k, v, g, beta, slots, path, accepted, track_node=None,
           track_dst=None, *, use_qk_l2norm=True):
    """Make draft node `accepted[b]` the committed state of slot `slots[b]` (negative: keep).

    State: replay the verified tokens marked in `path` `[B, N]` (`accepted_path`; k, v, g, beta
    `[B*N, ...]` as given to `gated_delta_rule_verify`) over the slot's committed state, in index
    order. Conv: copy the accepted node's window from `conv_scratch` `[B, N, C, K-1]`.

    track_node / track_dst `[B]` (optional; negative: none): also store the state and conv window
    of path node `track_node[b]` (the accepted node or one of its ancestors) in pool row
    `track_dst[b]`, the prefix cache's snapshot of the prefix that ends at that node.
    """
    batch, n = path.shape
    if track_node is None:
        track_node = track_dst = jnp.full((batch,), -1, jnp.int32)
    _, kf, vf, gf, bf = _prep(jnp.zeros_like(k), k, v, g, beta, None, use_qk_l2norm)
    shape = lambda a: a.reshape((batch, n) + a.shape[1:])  # noqa: E731
    kf, vf, gf, bf = map(shape, (kf, vf, gf, bf))
    state = state_pool[slots]
    tracked = state
    for i in range(n):
        nxt, _ = _step(state, kf[:, i], kf[:, i], vf[:, i], gf[:, i], bf[:, i])
        state = jnp.where(path[:, i, None, None, None], nxt, state)
        tracked = jnp.where((track_node == i)[:, None, None, None], state, tracked)
    rows = state_pool.shape[0]
    target = jnp.where(accepted >= 0, slots, rows)
    tracking = (accepted >= 0) & (track_node >= 0)
    snap = jnp.where(tracking, track_dst, rows)
    state_pool = state_pool.at[target].set(state, mode="drop").at[snap].set(tracked, mode="drop")
    at = jnp.arange(batch)
    last = conv_scratch[at, jnp.clip(accepted, 0, n - 1)]
    window = conv_scratch[at, jnp.clip(track_node, 0, n - 1)]
    conv_pool = conv_pool.at[target].set(last.astype(conv_pool.dtype), mode="drop")
    conv_pool = conv_pool.at[snap].set(window.astype(conv_pool.dtype), mode="drop")
    return state_pool, conv_pool


__all__ = [
    "l2_normalize",
    "causal_conv1d",
    "causal_conv1d_verify",
    "gated_delta_rule",
    "gated_delta_rule_verify",
    "ancestors",
    "accepted_path",
    "commit",
]
