"""Recurrent gated delta rule for speculative verification: draft tokens on a chain or a tree.

Each of a request's N draft tokens starts from its parent's state (`parents[b, j]`, -1 = the
committed state in the slot), never from the previous token's unless that is its parent. One program
per (request, value head, dv block) reads the committed state block once and keeps it and the
previous token's state in registers. Only the outputs are written: no state leaves the kernel, the
pool is only read, and `commit.py` later replays the accepted path. So verify moves one state block
per program where decode moves two (read and write), and pays no N-fold scratch write.

A parent that is neither the committed state nor the previous token (a tree branch) is rebuilt in
registers by replaying the tokens on its path from the committed state (`ancestors`, in index order,
which is root-first because parents come before children). Chains never take that branch; trees pay
extra arithmetic on register-resident data, not extra memory traffic.

A chain of 4 draft tokens costs little more than a decode step (figures, and the scratch-writing
design this replaced: NOTES.md).

Lowering: Triton (the same reasons as `recurrent.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gdn.common import ANY, block_for, delta_rule_token, triton_params
from pallas_kernels.gdn.reference import ancestors


def _verify_kernel(
    slots_ref, parents_ref, anc_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref,
    o_ref,
    *, num_draft, block_v, group, scale, use_qk_l2norm,
):
    b = pl.program_id(0)
    h = pl.program_id(1)
    jv = pl.program_id(2)
    hk = h // group
    cols = pl.ds(jv * block_v, block_v)
    committed = pool_ref[slots_ref[b], h, :, cols]
    tokens = (q_ref, k_ref, v_ref, g_ref, beta_ref)

    def step(s, t, out_ref):
        return delta_rule_token(s, t, h, hk, cols, *tokens, out_ref, scale=scale, use_qk_l2norm=use_qk_l2norm)

    def rebuild(p):
        """State after node p, replayed from the committed state along p's path."""
        def body(i, s):
            return jax.lax.cond(anc_ref[b, p, i] != 0, lambda: step(s, b * num_draft + i, None), lambda: s)
        return jax.lax.fori_loop(0, p + 1, body, committed)

    prev = committed
    for j in range(num_draft):
        if j == 0:
            s = committed  # the first draft token's parent is always the committed state
        else:
            p = parents_ref[b, j]

            def elsewhere(p=p):
                return jax.lax.cond(p < 0, lambda: committed, lambda: rebuild(jnp.maximum(p, 0)))

            s = jax.lax.cond(p == j - 1, lambda prev=prev: prev, elsewhere)
        prev = step(s, b * num_draft + j, o_ref)


def gated_delta_rule_verify(q, k, v, g, beta, state_pool, slots, parents, *, scale=None, use_qk_l2norm=True,
                            interpret=False, block_v=32, num_warps=4):
    """Pallas version of `reference.gated_delta_rule_verify` (same arguments and result)."""
    batch, num_draft = parents.shape
    _, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    if scale is None:
        scale = dk ** -0.5
    block_v = block_for(dv, block_v)
    kernel = functools.partial(
        _verify_kernel, num_draft=num_draft, block_v=block_v, group=num_v_heads // num_k_heads,
        scale=float(scale), use_qk_l2norm=use_qk_l2norm)
    anc = ancestors(parents.astype(jnp.int32)).astype(jnp.int32)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch * num_draft, num_v_heads, dv), q.dtype),
        grid=(batch, num_v_heads, dv // block_v),
        in_specs=[ANY] * 9,
        out_specs=ANY,
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="gdn_verify",
    )(slots.astype(jnp.int32), parents.astype(jnp.int32), anc, q, k, v, g, beta, state_pool)
