"""Static buffers for the carry between the parts of a constrained speculative step.

XLA runs each part as a captured graph (a command buffer) and re-records the graph before a launch
whenever a buffer it reads or writes has a new address; the re-recording is host time on the
host's path between the parts (measured: bench/README.md, "Structured output"). The carry between
the parts is dozens of small arrays (the unpacked inputs, the sampling batch, drafts, the target's
logits), each a fresh output of one part and a fresh input of the next, so without the arena
every part's graph is re-recorded every step.

Here the carry lives in a few flat buffers instead, one per dtype (the arena): each part unpacks
what it reads from the arena and writes what it hands on into the same buffers, donated, so XLA
updates them in place and their addresses stay put, as a CUDA graph runner's static input buffers
do (SGLang's `CudaGraphRunner`). Where each carried array sits is fixed when the parts are traced
(`CarryLayout`). One arena lives at a time (`ArenaKeeper`, one per model runner), handed from step
to step among the executables whose arenas have its shapes. Every chain length of a batch width
lays its arena out for the longest (`abstract_arena`'s floor): the adaptive policy switches chains
every few steps, and a switch that needed a new arena would also re-record every captured part of
both chains. A step of another width drops the arena and fills its own on the device. Every
bucket's split step may use one (`compile_options.uses_static_carry`); the widest's holds the
target's float32 logits over all its verified nodes, and the memory plan counts the largest
(`arena_bytes`, `ModelRunner.workspace_bytes`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


class CarryLayout:
    """Where each leaf of one carry tree sits in the arena: leaf i at offset[i] of the buffer of its
    dtype, in tree order. Built from abstract shapes; `write` and `read` run while a part traces."""

    def __init__(self, tree):
        leaves, self.treedef = jax.tree.flatten(tree)
        self.slots: list[tuple[str, int, tuple[int, ...]]] = []  # (dtype name, offset, shape)
        self.sizes: dict[str, tuple[int, np.dtype]] = {}  # dtype name -> (elements, dtype)
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            at = self.sizes.get(dtype.name, (0, dtype))[0]
            self.slots.append((dtype.name, at, tuple(leaf.shape)))
            self.sizes[dtype.name] = (at + int(np.prod(leaf.shape, dtype=np.int64)), dtype)

    def write(self, arena: dict, tree) -> dict:
        """The arena with tree's leaves written at their places (each dtype's buffer updated in
        place when the arena is donated)."""
        leaves = self.treedef.flatten_up_to(tree)
        flat: dict[str, list] = {}
        for (name, _, _), leaf in zip(self.slots, leaves):
            flat.setdefault(name, []).append(jnp.ravel(leaf))
        out = dict(arena)
        for name, parts in flat.items():
            out[name] = jax.lax.dynamic_update_slice(arena[name], jnp.concatenate(parts), (0,))
        return out

    def read(self, arena: dict):
        """The carry tree back from the arena."""
        leaves = [jax.lax.slice(arena[name], (at,), (at + int(np.prod(shape, dtype=np.int64)),)).reshape(shape)
                  for name, at, shape in self.slots]
        return jax.tree.unflatten(self.treedef, leaves)


def abstract_arena(layouts: list[CarryLayout], sharding, floor: dict | None = None) -> dict:
    """The arena's buffers, abstract: per dtype, enough elements for the largest carry of any part,
    and at least floor's ({dtype name: (elements, dtype)}, as `CarryLayout.sizes`: the longest
    chain's carry, so that every chain of a width takes the same arena)."""
    sizes: dict[str, tuple[int, np.dtype]] = dict(floor or {})
    for layout in layouts:
        for name, (n, dtype) in layout.sizes.items():
            sizes[name] = (max(sizes.get(name, (0, dtype))[0], n), dtype)
    return {name: jax.ShapeDtypeStruct((n,), dtype, sharding=sharding) for name, (n, dtype) in sorted(sizes.items())}


def arena_bytes(spec: dict) -> int:
    """Bytes of an arena shaped as spec ({dtype name: array with shape and dtype})."""
    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in spec.values())


def arena_shapes(spec: dict) -> tuple:
    """An arena's shapes as a key: ((dtype name, shape, dtype), ...)."""
    return tuple((name, tuple(x.shape), np.dtype(x.dtype)) for name, x in spec.items())


def compile_zeros(spec: dict, sharding):
    """A compiled function () -> a zeroed arena shaped as spec, filled on the device: a step after
    one of another width needs one, and a copy from the host would cost a transfer of the whole
    arena there; compiled with the bucket's parts, so serving compiles nothing. Buckets whose
    arenas have the same shapes (a width's chains and sampler variants) share one compile."""
    return _compile_zeros(arena_shapes(spec), sharding)


@functools.lru_cache(maxsize=None)
def _compile_zeros(shapes: tuple, sharding):
    out = {name: sharding for name, _, _ in shapes}
    return jax.jit(lambda: {name: jnp.zeros(shape, dtype) for name, shape, dtype in shapes},
                   out_shardings=out).lower().compile()


class ArenaKeeper:
    """The one live arena of a model runner's split steps, kept between steps and handed to the next
    step whose arena has its shapes (a step of another shape drops it: its buffers are freed once
    no launched part still reads them)."""

    def __init__(self):
        self._shapes = None
        self._arena = None
        self.fills = 0  # new arenas made (server_info's num_carry_arena_fills): each re-records the graphs

    def take(self, shapes: tuple, make) -> dict:
        """An arena of `shapes` (`arena_shapes`) for the next draft part, which donates it: the kept
        one when it has those shapes, else make()'s (a new zeroed one; also when a failed step
        deleted the kept one's buffers). Its contents are whatever the last step left: every part
        writes what it hands on before the next part reads it."""
        arena = self._arena if self._shapes == shapes else None
        self._shapes = self._arena = None
        if arena is None or any(a.is_deleted() for a in arena.values()):
            arena = make()
            self.fills += 1
        return arena

    def keep(self, shapes: tuple, arena: dict) -> None:
        """Keep arena (of `shapes`) until the next step takes it."""
        self._shapes, self._arena = shapes, arena
