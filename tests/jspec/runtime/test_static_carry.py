"""`jspec.runtime.static_carry`: a carry tree written into the arena and read back is unchanged,
every dtype in a buffer of its own, and a part that writes a donated arena keeps its addresses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.runtime import static_carry


def _tree(seed: int):
    r = np.random.default_rng(seed)
    return {"x": {"positions": jnp.asarray(r.integers(0, 99, (5,)), jnp.int32),
                  "seeds": jnp.asarray(r.integers(0, 9, ()), jnp.int32)},
            "hidden": jnp.asarray(r.standard_normal((2, 3, 4)), jnp.bfloat16),
            "logits": jnp.asarray(r.standard_normal((2, 7)), jnp.float32),
            "valid": jnp.asarray(r.integers(0, 2, (2,)), bool), "none": None}


def test_a_carry_round_trips_through_the_arena_in_place():
    tree, smaller = _tree(0), {"drafts": jnp.arange(6, dtype=jnp.int32).reshape(2, 3)}
    big, small = static_carry.CarryLayout(tree), static_carry.CarryLayout(smaller)
    spec = static_carry.abstract_arena([big, small], None)
    assert {k: (v.shape, v.dtype) for k, v in spec.items()} == {
        "bfloat16": ((24,), jnp.bfloat16), "bool": ((2,), jnp.bool_), "float32": ((14,), jnp.float32),
        "int32": ((6,), jnp.int32)}  # int32: the larger of 5 + 1 and 6
    arena = static_carry.new_arena(spec, jax.devices()[0])
    write = jax.jit(lambda arena, tree: big.write(arena, tree), donate_argnums=(0,))
    where = None  # from the first write on (a CPU buffer made from numpy may not be donatable)
    for seed in (1, 2, 3):
        tree = _tree(seed)
        arena = write(arena, tree)
        now = {k: a.unsafe_buffer_pointer() for k, a in arena.items()}
        assert now == (where or now)  # written in place
        where = now
        back = jax.jit(big.read)(arena)
        assert jax.tree.structure(back) == jax.tree.structure(tree)
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
            assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want))
    arena = jax.jit(lambda arena: small.write(arena, smaller), donate_argnums=(0,))(arena)
    assert np.array_equal(np.asarray(jax.jit(small.read)(arena)["drafts"]), np.asarray(smaller["drafts"]))
