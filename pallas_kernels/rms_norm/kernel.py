"""The residual add and the RMSNorm that follows it, in one kernel.

A decoder layer adds the attention (or mixer) output to the residual stream and norms the sum for
its MLP, then adds the MLP output and norms that for the next layer. In XLA each of these is an add,
a reduction and a product: three launches (and the gaps between them) where one program per token
row can load the two rows once, add, reduce and scale in registers, and store both the new residual
and its norm.

Without a delta (a stack's first layer) it norms x alone and returns it as the residual: every
layer's input then comes out of this kernel, so the step traces each layer's kernels with one
input type (a Pallas output carries no mesh, an XLA one does).

Rounding as `reference.add_rms_norm` writes it: the sum rounded to the activation dtype (it is the
residual stream), then the norm of that rounded sum in float32, rounded before the weight (Llama /
Qwen3) or after it (zero-centred weights, Qwen3-Next).

Lowering: Triton (one masked row vector per program; runs in CPU interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

ANY = pl.BlockSpec(memory_space=pl.ANY)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def scale(normed, w, *, dtype, zero_centred: bool):
    """The weight step of an RMSNorm inside a kernel, as `reference.rms_norm` rounds it: float32
    normed values and weights in, dtype out (rounded before the weight, or once after 1 + w)."""
    if zero_centred:
        return (normed * (1.0 + w)).astype(dtype)
    return (w * normed.astype(dtype).astype(jnp.float32)).astype(dtype)


def _kernel(x_ref, *refs, width, block, eps, zero_centred, has_delta):
    delta_ref, w_ref, res_ref, out_ref = refs if has_delta else (None, *refs)
    t = pl.program_id(0)
    cols = pl.ds(0, block)
    live = jax.lax.broadcasted_iota(jnp.int32, (block,), 0) < width
    dtype = res_ref.dtype
    s = plt.load(x_ref.at[t, cols], mask=live, other=0.0)
    if has_delta:
        s = (s.astype(jnp.float32) + plt.load(delta_ref.at[t, cols], mask=live, other=0.0).astype(jnp.float32))
    s = s.astype(dtype)
    plt.store(res_ref.at[t, cols], s, mask=live)
    sf = s.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.sum(sf * sf) / width + eps)
    w = plt.load(w_ref.at[cols], mask=live, other=0.0).astype(jnp.float32)
    plt.store(out_ref.at[t, cols], scale(sf * r, w, dtype=dtype, zero_centred=zero_centred), mask=live)


def add_rms_norm(x, delta, weight, *, eps: float, zero_centred: bool, interpret: bool = False, num_warps: int = 4):
    """Same arguments and results as `reference.add_rms_norm`, plus `interpret` and `num_warps`."""
    tokens, width = x.shape
    if (delta is not None and delta.shape != x.shape) or weight.shape != (width,):
        raise ValueError(f"add_rms_norm: x {x.shape}, delta {None if delta is None else delta.shape} and weight "
                         f"{weight.shape} must be [T, E], [T, E] (or None) and [E]")
    dtype = x.dtype if delta is None else jnp.result_type(x.dtype, delta.dtype)
    inputs = (x, weight) if delta is None else (x, delta, weight)
    kernel = functools.partial(_kernel, width=width, block=_pow2(width), eps=float(eps), zero_centred=zero_centred,
                               has_delta=delta is not None)
    return pl.pallas_call(
        kernel,
        grid=(tokens,),
        in_specs=[ANY] * len(inputs),
        out_specs=[ANY, ANY],
        out_shape=[jax.ShapeDtypeStruct((tokens, width), dtype), jax.ShapeDtypeStruct((tokens, width), dtype)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*inputs)
