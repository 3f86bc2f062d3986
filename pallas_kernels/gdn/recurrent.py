"""Recurrent gated delta rule for decode: token by token, state block in registers.

One program per (request, value head, dv block) loads its state block `S [dk, BV]` once, runs the
request's tokens through the recurrence (one for decode) and writes the block back, so the state,
64 KiB per head in float32, crosses memory exactly twice. All arithmetic is elementwise multiplies
and reductions over dk in float32, exactly the reference's order of operations:
    S *= exp(g);  delta = beta (v - k^T S);  S += k delta^T;  o = q^T S.

Requests may hold any number of tokens (the ragged layout of `reference.gated_delta_rule`), so the
kernel is correct for any input; it is fast when each holds one or a few. Padding tokens past
cu_seqlens[B] get zeros, spread over the programs of all requests.

As fast as flash-linear-attention's fused_recurrent at decode shapes and several times faster than
a vectorised XLA step. BV = 64 and 4 warps (BV = 16 is much slower). Figures in NOTES.md.

Lowering: Triton, by measurement. The work is a memory-bound stream over the state blocks with
slot indirection. Probe kernels that only move this state (no math; bench/kernels/gdn_state_probe.py)
stream it equally fast through either lowering, Triton pointer loads and stores or Mosaic GPU TMA
copies through shared memory, at every BV tried, so a TMA kernel would not move the state faster.
Triton keeps the same kernel runnable in CPU interpret mode, so the tested kernel is the shipped one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.common import ANY, block_for, cdiv, delta_rule_token, splat, triton_params


def _recurrent_kernel(
    cu_ref, slots_ref, init_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref,
    o_ref, pool_out_ref,
    *, block_v, group, scale, use_qk_l2norm,
):
    b = pl.program_id(0)
    h = pl.program_id(1)
    jv = pl.program_id(2)
    batch = pl.num_programs(0)
    hk = h // group
    num_tokens = q_ref.shape[0]
    dk = q_ref.shape[-1]
    cols = pl.ds(jv * block_v, block_v)
    r0 = cu_ref[b]
    r1 = cu_ref[b + 1]
    slot = slots_ref[b]

    def token(t, s):
        return delta_rule_token(s, t, h, hk, cols, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref,
                                scale=scale, use_qk_l2norm=use_qk_l2norm)

    @pl.when(r1 > r0)
    def _():
        s0 = plt.load(pool_ref.at[slot, h, :, cols], mask=splat(init_ref[b] != 0, (dk, block_v)), other=0.0)
        s = jax.lax.fori_loop(r0, r1, token, s0)
        plt.store(pool_out_ref.at[slot, h, :, cols], s)

    # Padding tokens cu[B] + b, cu[B] + b + B, ... belong to this program (none when T == cu[B]).
    first_pad = cu_ref[batch] + b
    zeros = jnp.zeros((block_v,), o_ref.dtype)

    def pad(i, carry):
        o_ref[first_pad + i * batch, h, cols] = zeros
        return carry

    jax.lax.fori_loop(0, cdiv(jnp.maximum(num_tokens - first_pad, 0), batch), pad, 0)


def gated_delta_rule_decode(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial, *, scale=None,
                            use_qk_l2norm=True, interpret=False, block_v=64, num_warps=4):
    """Pallas recurrent kernel with `reference.gated_delta_rule`'s arguments and results.

    Meant for decode (one token per request: T == B, cu_seqlens = arange(B + 1)).
    """
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    batch = slots.shape[0]
    if scale is None:
        scale = dk ** -0.5
    block_v = block_for(dv, block_v)
    kernel = functools.partial(_recurrent_kernel, block_v=block_v, group=num_v_heads // num_k_heads,
                               scale=float(scale), use_qk_l2norm=use_qk_l2norm)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, num_v_heads, dv), q.dtype),
            jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        ),
        grid=(batch, num_v_heads, dv // block_v),
        in_specs=[ANY] * 9,
        out_specs=[ANY] * 2,
        input_output_aliases={8: 1},
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="gdn_recurrent",
    )(cu_seqlens.astype(jnp.int32), slots.astype(jnp.int32), has_initial.astype(jnp.int32), q, k, v, g, beta,
      state_pool)
