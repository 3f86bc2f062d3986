"""One-shot all-reduce over NVLink peer memory, as a Mosaic GPU kernel.

A tensor-parallel decode step at batch 1 all-reduces a few KiB twice per layer, so latency, not
bandwidth, is what it pays. The kernel reads every peer's buffer directly (the buffers of one
process's GPUs are mapped into each other's address space) and adds in registers: the "one-shot"
all-reduce of SGLang's and vLLM's custom all-reduce, written with Pallas' Mosaic GPU primitives
(`remote_ref`, cross-device semaphores). JAX's runtime hands each kernel its peers' buffer
addresses; no communication library of ours is involved. How it compares with XLA's NCCL
all-reduce, and why the models do not use it: NOTES.md beside this file.

Each block owns one tile of the flattened buffer. JAX's runtime runs a cross-device barrier just
before a kernel that reads peer memory (its inputs are ready on every device when it starts), so
`handshake=False` skips the kernel's own readiness exchange; with `handshake=True` each block tells
every peer its input is ready and waits for theirs first. It then sums the tile from every device in
float32 in a fixed device order (so every device computes bit-identical results), writes it, then
waits until every peer has read its tile before exiting (its input may be freed or overwritten
by the next op once the kernel ends).

NVLink SHARP (`multimem` loads that the switch reduces, JAX's `reduce_scatter_mgpu`) would halve
the traffic, but it needs multicast objects (cuMulticastCreate), which the shared GPU hosts this
project runs on keep off; the kernel reads peers' buffers with plain loads instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE = 4096  # elements per block: 32 per thread of a 128-thread block at bf16 (8 KiB)


def one_shot_all_reduce(x: jax.Array, axis_name: str, num_devices: int, *, tile: int = TILE,
                        handshake: bool = False, interpret: bool = False) -> jax.Array:
    """Sum of x over the mesh axis `axis_name` (call it under shard_map); x's size a multiple of
    128 (a whole tile, or divisible into whole tiles)."""
    n = math.prod(x.shape)
    tile = min(tile, n)
    if n % tile or tile % 128:
        raise ValueError(f"one_shot_all_reduce: {n} elements do not split into tiles of {tile} "
                         "(a multiple of 128)")
    blocks = n // tile
    flat = x.reshape(blocks, tile)

    def kernel(x_ref, y_ref, ready, done):
        b = lax.axis_index("blocks")
        me = lax.axis_index(axis_name)
        peers = [lax.rem(me + k, num_devices) for k in range(1, num_devices)]
        if handshake:
            for p in peers:
                pl.semaphore_signal(ready.at[b], device_id=p)
            pl.semaphore_wait(ready.at[b], num_devices - 1)
        # The sum in device order 0..n-1, so that every device rounds identically.
        acc = None
        for d in range(num_devices):
            src = plgpu.remote_ref(x_ref, jnp.int32(d)) if num_devices > 1 else x_ref
            part = src.at[b][...].astype(jnp.float32)
            acc = part if acc is None else acc + part
        y_ref.at[b][...] = acc.astype(y_ref.dtype)
        for p in peers:
            pl.semaphore_signal(done.at[b], device_id=p)
        pl.semaphore_wait(done.at[b], num_devices - 1)

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(flat.shape, x.dtype),
        grid=(blocks,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SemaphoreType.REGULAR((blocks,)), plgpu.SemaphoreType.REGULAR((blocks,))],
        interpret=interpret,
    )(flat)
    return out.reshape(x.shape)

