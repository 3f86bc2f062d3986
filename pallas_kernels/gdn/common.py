"""Helpers shared by the Gated DeltaNet Pallas kernels.

All GDN kernels here are generic `pl.pallas_call` kernels (whole arrays in `pl.ANY`, explicit
`plt.load` / `plt.store` with masks): they lower through Triton on the GPU and run in interpret mode
on the CPU, so the CPU tests exercise the very code that runs on the GPU. Why Triton rather than
Mosaic GPU is said in each kernel's docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

CHUNK = 64  # tokens per chunk of the chunked prefill
L2_EPS = 1e-6  # as reference.l2_normalize

# Every operand is a whole array in global memory; the kernels index it themselves, because ragged
# sequences and slot indirection don't fit rectangular BlockSpecs.
ANY = pl.BlockSpec(memory_space=pl.ANY)


def triton_params(num_warps: int = 4, num_stages: int = 1):
    """Compiler params that select the Triton lowering (Mosaic GPU is the default on jax >= 0.11)."""
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def cdiv(a, b):
    return (a + b - 1) // b


def matmul_dtype(dtype):
    """Operand dtype of the tensor-core dots: 16-bit inputs stay 16-bit (as flash-linear-attention
    does), float32 inputs stay float32 so the CPU tests compare at float32 precision."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with float32 accumulation; transposes fold into the dot (no data movement)."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def inv_norm(x):
    """1 / ||x|| over the last axis, with the reference's epsilon inside the square root."""
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1) + L2_EPS)


def full_mask(rows, cols):
    """Broadcast a row mask `[R]` and a column mask `[C]` to `[R, C]` (Triton wants exact shapes)."""
    return jnp.logical_and(rows[:, None], cols[None, :])


def row_mask(rows, num_cols: int):
    """A row mask `[R]` broadcast over `num_cols` columns. Constant along each row, so Triton keeps
    wide vector loads / stores; a mask that also varies along the columns may not."""
    return jnp.broadcast_to(rows[:, None], (rows.shape[0], num_cols))


def load(ref, mask=None):
    """`plt.load` with zeros where `mask` is False; no mask at all when it is None."""
    return ref[...] if mask is None else plt.load(ref, mask=mask, other=0.0)


def store(ref, value, mask=None):
    if mask is None:
        ref[...] = value
    else:
        plt.store(ref, value, mask=mask)


def splat(cond, shape):
    """A scalar condition as a mask of `shape`: a load/store guarded by a run-time scalar."""
    return jnp.full(shape, cond, dtype=jnp.bool_)


def block_for(dim: int, want: int) -> int:
    """Largest power of two <= want that divides dim (kernel tiles must be powers of two)."""
    b = 1
    while b * 2 <= want and dim % (b * 2) == 0:
        b *= 2
    return b


def delta_rule_token(s, t, h, hk, cols, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, *, scale, use_qk_l2norm):
    """One token of the gated delta rule for value head h (its dv columns `cols`), in registers:
    decay the state [dk, block_v], correct it towards v along k, and (unless o_ref is None, as in a
    replay) write q^T S to o_ref[t, h, cols]. Shared by the recurrent (decode), verify and commit
    kernels, so all three round alike. Returns the new state."""
    k = k_ref[t, hk, :].astype(jnp.float32)
    if use_qk_l2norm:
        k = k * inv_norm(k)
    v = v_ref[t, h, cols].astype(jnp.float32)
    s = s * jnp.exp(g_ref[t, h].astype(jnp.float32))
    delta = (v - jnp.sum(s * k[:, None], axis=0)) * beta_ref[t, h].astype(jnp.float32)
    s = s + k[:, None] * delta[None, :]
    if o_ref is not None:
        q = q_ref[t, hk, :].astype(jnp.float32)
        if use_qk_l2norm:
            q = q * inv_norm(q)
        q = q * scale
        o_ref[t, h, cols] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    return s
