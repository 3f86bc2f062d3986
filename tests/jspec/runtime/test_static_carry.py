"""`jspec.runtime.static_carry`: a carry tree written into the arena and read back is unchanged,
every dtype in a buffer of its own, and a part that writes a donated arena keeps its addresses;
one arena lives at a time, handed from step to step among executables whose arenas have its
shapes, which every chain of a width shares."""

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
    assert static_carry.arena_bytes(spec) == 24 * 2 + 2 + 14 * 4 + 6 * 4
    arena = static_carry.compile_zeros(spec, jax.sharding.SingleDeviceSharding(jax.devices()[0]))()
    assert all(not np.asarray(a).any() and a.shape == spec[k].shape and a.dtype == spec[k].dtype
               for k, a in arena.items())
    write = jax.jit(lambda arena, tree: big.write(arena, tree), donate_argnums=(0,))
    where = None
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


def test_one_arena_lives_at_a_time_handed_on_by_its_shapes():
    """The keeper hands the kept arena to the next step whose arena has its shapes (another chain of
    the same width: no fill, the same addresses for every part's graph); a take of other shapes
    drops it (a new one made), and so does a kept arena whose buffers a failed step deleted."""
    keeper, made = static_carry.ArenaKeeper(), []
    wide = static_carry.arena_shapes({"int32": jax.ShapeDtypeStruct((8,), jnp.int32)})
    narrow = static_carry.arena_shapes({"int32": jax.ShapeDtypeStruct((4,), jnp.int32)})

    def make():
        made.append({"int32": jnp.zeros((4,), jnp.int32)})
        return made[-1]

    first = keeper.take(narrow, make)
    assert first is made[0] and keeper.fills == 1
    keeper.keep(narrow, first)
    assert keeper.take(narrow, make) is first and len(made) == 1  # the same shapes: kept
    keeper.keep(narrow, first)
    other = keeper.take(wide, make)
    assert other is made[1]
    keeper.keep(wide, other)
    assert keeper.take(narrow, make) is made[2]  # the wide one was dropped; a new one
    keeper.keep(narrow, made[2])
    made[2]["int32"].delete()
    assert keeper.take(narrow, make) is made[3]
    assert keeper.take(narrow, make) is made[4]  # taken and not kept: nothing held
    assert keeper.fills == 5


def test_a_shorter_chain_lays_its_arena_out_for_its_full_chain():
    """`split_step.ArenaFloors`: a shorter chain's floor is the carry of the full chain of its width
    (its grammar nodes, not the shorter chain's), traced once for all shorter chains, or not at all
    where the full chain's lowering came first; a full chain has none; an arena laid out with the
    floor has the full chain's shapes, and a shorter chain's carry written over what the full chain
    left reads back unchanged."""
    import dataclasses
    import types

    from jspec.models.batch import ForwardMode
    from jspec.runtime import split_step
    from jspec.runtime.step_inputs import Bucket

    class Chain:  # 3 drafts: 4 nodes; k drafts: k + 1
        def grammar_nodes(self, steps):
            return (steps + 1, steps) if steps else (4, 3)

    traced = []

    def step_fn(bucket):
        traced.append(bucket)
        b, n = bucket.batch_size, bucket.grammar_nodes

        def draft(params, state, packed):
            return {"kv": state}, {"logits": jnp.zeros((b, n, 5)), "drafts": jnp.zeros((b, n), jnp.int32)}, packed

        def forward(params, buffers, rest, decisions):
            assert decisions.shape == (bucket.grammar_size,)
            return buffers, {**rest, "hidden": jnp.zeros((b * n, 3), jnp.bfloat16)}
        return types.SimpleNamespace(draft=draft, forward=forward)

    def bucket(k):
        return Bucket(ForwardMode.DECODE, 2, 2, 2, speculate=True, draft_steps=k,
                      **split_step.grammar_fields(3, Chain(), True, k, pipeline=True))

    state, full = jax.ShapeDtypeStruct((4,), jnp.float32), bucket(0)
    want = {"bfloat16": (2 * 4 * 3, np.dtype(jnp.bfloat16)), "float32": (2 * 4 * 5, np.dtype(np.float32)),
            "int32": (2 * 4, np.dtype(np.int32))}
    floors = split_step.ArenaFloors(Chain(), step_fn)  # the full chain not lowered here: traced once
    assert floors.floor(bucket(1), None, None, state, None) == want
    assert floors.floor(bucket(2), None, None, state, None) == want
    assert traced == [full]
    # The full chain lowered first: its own layouts serve its shorter chains, nothing traced.
    split, packed = step_fn(full), jax.ShapeDtypeStruct((full.size,), jnp.int32)
    buffers, rest, _ = jax.eval_shape(split.draft, None, state, packed)
    layouts = split_step.carry_layouts(split, None, buffers, rest, jax.ShapeDtypeStruct((full.grammar_size,), jnp.int32))
    floors, traced[:] = split_step.ArenaFloors(Chain(), step_fn), []
    assert floors.floor(full, layouts, None, state, None) is None
    assert floors.floor(bucket(1), None, None, state, None) == want and not traced
    short = static_carry.CarryLayout({"logits": jnp.ones((2, 2, 5)), "drafts": jnp.full((2, 2), 7, jnp.int32)})
    spec = static_carry.abstract_arena([short], None, want)
    assert {k: v.shape[0] for k, v in spec.items()} == {k: n for k, (n, _) in want.items()}
    left = {k: jnp.full(v.shape, 9, v.dtype) for k, v in spec.items()}  # what a full chain's step left
    carry = {"logits": jnp.arange(20, dtype=jnp.float32).reshape(2, 2, 5), "drafts": jnp.full((2, 2), 3, jnp.int32)}
    back = short.read(short.write(left, carry))
    assert all(np.array_equal(np.asarray(back[k]), np.asarray(carry[k])) for k in carry)
    assert dataclasses.replace(bucket(2), draft_steps=0) != full  # the floor needs the full chain's grammar fields


def test_the_memory_plan_counts_the_widest_buckets_arena(monkeypatch):
    """`ModelRunner.workspace_bytes`: the largest temporaries of the largest prompt and decode
    buckets' parts, plus the decode bucket's arena where its split step carries in one (one arena
    lives at a time)."""
    import dataclasses
    import types

    from jspec.models.batch import ForwardMode
    from jspec.runtime.model_runner import ModelRunner
    from jspec.runtime.step_inputs import Bucket

    class Chain:
        def grammar_nodes(self, steps):
            return 4, 3

    @dataclasses.dataclass
    class Layout:
        min_pages: int = 2
        num_pages: int | None = None

    spec = {"float32": jax.ShapeDtypeStruct((1000,), jnp.float32), "int32": jax.ShapeDtypeStruct((10,), jnp.int32)}
    split = Bucket(ForwardMode.DECODE, 8, 8, 8, grammar_split=True, grammar_nodes=4, mask_words=2)
    prompt = Bucket(ForwardMode.EXTEND, 64, 2, 16)

    def part(temp, args=()):
        return types.SimpleNamespace(memory_analysis=lambda: types.SimpleNamespace(temp_size_in_bytes=temp),
                                     args_info=(args,))

    parts = {split: [part(300, (None, None, None, spec)), part(500), part(200)], prompt: [part(700)]}
    runner = ModelRunner.__new__(ModelRunner)
    runner.layout = Layout()
    runner.buckets, runner.drafting, runner.executables = [split, prompt], Chain(), None
    monkeypatch.setattr(ModelRunner, "_abstract_state", lambda self, layout: None)
    monkeypatch.setattr(ModelRunner, "_compiled_parts", lambda self, bucket, state, cached=True: parts[bucket])
    monkeypatch.delenv("JSPEC_GRAMMAR_STATIC_CARRY", raising=False)
    assert runner.workspace_bytes() == 500 + 4040  # the decode parts' largest temporaries and the arena
    monkeypatch.setenv("JSPEC_GRAMMAR_STATIC_CARRY", "0")
    assert runner.workspace_bytes() == 700  # no arena: the prompt step's temporaries are the most
