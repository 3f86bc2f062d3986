"""Routed experts for few tokens, in plain jnp: the oracle of the Pallas gather-GEMV kernels.

This is `SparseMoE._routed_gather`'s math as it stood before the kernels: every (token, expert)
pair gathers its expert's whole weights and runs two small GEMVs. Intermediates are rounded to the
activation dtype where that code rounded them (the gate_up product, silu(gate) * up, the down
product); the weighted sum over the K experts of a token runs in float32.

It materialises one expert slab per pair: cheap for the tiny models of the CPU tests, but at real
shapes and verify sizes it is the memory hog the kernels avoid (Qwen3-Next, T=256: 2560 slabs of
6 MB), so on the GPU only the kernels' unsupported shapes and the benchmark's small-T rows run it.

Shapes (DESIGN.md letters; X experts, I the expert intermediate size):
    x        [T, E]       activations
    experts  [T, K]       int, expert of each (token, k) pair; any values in [0, X), repeats allowed
    weights  [T, K]       routing weights (x's dtype)
    gate_up  [X, E, 2I]   gate columns first, then up columns (jspec's `Experts.gate_up_proj`)
    down     [X, I, E]    (jspec's `Experts.down_proj`)
    result   [T, E]       x's dtype
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def moe_gather(x, experts, weights, gate_up, down):
    t, e = x.shape
    k = experts.shape[1]
    flat = experts.reshape(-1)
    rows = jnp.repeat(x, k, axis=0)  # [T*K, E]
    h = jnp.einsum("ne,nei->ni", rows, gate_up[flat])
    gate, up = jnp.split(h, 2, axis=-1)
    y = jnp.einsum("ni,nie->ne", jax.nn.silu(gate) * up, down[flat])
    y = y.reshape(t, k, e).astype(jnp.float32) * weights[:, :, None].astype(jnp.float32)
    return jnp.sum(y, axis=1).astype(x.dtype)
