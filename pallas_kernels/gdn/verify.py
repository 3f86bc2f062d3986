"""Recurrent gated delta rule for speculative verification: draft tokens on a chain or a tree.

Each of a request's N draft tokens starts from its parent's state (`parents[b, j]`, -1 = the
committed state in the slot), never from the previous token's unless that is its parent. One program
per (request, value head, dv block) reads the committed state block once, keeps it and the previous
token's state in registers, and writes every token's state to scratch `[B, N, Hv, dk, dv]`; the pool
is only read. A parent that is neither the committed state nor the previous token is read back from
the scratch this program has just written (an L2 hit; a barrier orders it after the writes), so
register use does not grow with N and chains pay nothing for tree support.

Cost floor: the scratch write is N state blocks, so against decode (read + write one block) the
bytes are (1 + N) / 2 times larger: 2.5x for N = 4 when both run at memory speed.

Measured (H200, jax 0.11.2, bench/results/kernels_gdn_h200.json), 32 requests, N = 4: 0.136 ms chain, 0.142 ms tree
= 2.6x the decode step (2.5 TB/s); the reference's XLA version 0.46 ms.

Lowering: Triton (the same reasons as `recurrent.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.common import ANY, block_for, delta_rule_token, triton_params


def _verify_kernel(
    slots_ref, parents_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref,
    o_ref, scratch_ref,
    *, num_draft, block_v, group, scale, use_qk_l2norm, barrier,
):
    b = pl.program_id(0)
    h = pl.program_id(1)
    jv = pl.program_id(2)
    hk = h // group
    cols = pl.ds(jv * block_v, block_v)
    committed = pool_ref[slots_ref[b], h, :, cols]
    prev = committed
    for j in range(num_draft):
        t = b * num_draft + j
        if j == 0:
            s = committed  # the first draft token's parent is always the committed state
        else:
            p = parents_ref[b, j]

            def elsewhere(p=p):
                return jax.lax.cond(p < 0, lambda: committed,
                                    lambda: scratch_ref[b, jnp.maximum(p, 0), h, :, cols])

            s = jax.lax.cond(p == j - 1, lambda prev=prev: prev, elsewhere)

        s = delta_rule_token(s, t, h, hk, cols, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref,
                             scale=scale, use_qk_l2norm=use_qk_l2norm)
        scratch_ref[b, j, h, :, cols] = s
        if barrier and j + 1 < num_draft:
            plt.debug_barrier()  # later tokens may read this state back from scratch
        prev = s


def gated_delta_rule_verify(q, k, v, g, beta, state_pool, slots, parents, *, scale=None, use_qk_l2norm=True,
                            interpret=False, block_v=32, num_warps=4):
    """Pallas version of `reference.gated_delta_rule_verify` (same arguments and results)."""
    batch, num_draft = parents.shape
    _, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    if scale is None:
        scale = dk ** -0.5
    block_v = block_for(dv, block_v)
    kernel = functools.partial(
        _verify_kernel, num_draft=num_draft, block_v=block_v, group=num_v_heads // num_k_heads,
        scale=float(scale), use_qk_l2norm=use_qk_l2norm, barrier=not interpret)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((batch * num_draft, num_v_heads, dv), q.dtype),
            jax.ShapeDtypeStruct((batch, num_draft, num_v_heads, dk, dv), jnp.float32),
        ),
        grid=(batch, num_v_heads, dv // block_v),
        in_specs=[ANY] * 8,
        out_specs=[ANY] * 2,
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="gdn_verify",
    )(slots.astype(jnp.int32), parents.astype(jnp.int32), q, k, v, g, beta, state_pool)
