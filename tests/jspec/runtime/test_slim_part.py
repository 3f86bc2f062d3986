"""A split step's part compiled on the arrays it reads: arrays it never reads are not arguments,
arrays it hands back unchanged come back as the same objects (not donated, not copied), arrays it
writes are donated; the results equal the whole function's, shardings kept, and the part survives
the executable cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.runtime import executable_cache, slim_part
from jspec.runtime.executable_cache import ExecutableCache


def step(params, state, x):
    """Reads w (not `unused`), writes kv, passes `pool` through, returns a None field."""
    w, unused = params
    kv = state["kv"] + x @ w
    return {"kv": kv, "pool": state["pool"], "empty": None}, jnp.sum(kv) * 2, state["count"]


def args():
    params = (jnp.arange(9.0).reshape(3, 3), jnp.ones(5))
    state = {"kv": jnp.ones(3), "pool": jnp.arange(4.0), "count": jnp.int32(7)}
    return params, state, jnp.arange(3.0)


def test_a_slim_part_takes_what_it_reads_and_hands_back_what_it_passes_through():
    params, state, x = args()
    want = jax.jit(step)(params, dict(state), x)
    lowered = slim_part.lower(step, (params, state, x), donate_argnums=(1,), out_shardings=None)
    plan = lowered.plan
    # leaves: w 0, unused 1, count 2, kv 3, pool 4, x 5 (dict keys sorted)
    assert plan.read == (0, 5) and plan.donated == (3,)
    assert sorted(i for _, i in plan.passed) == [2, 4]
    part = lowered.compile()
    assert len(jax.tree.leaves(part.compiled.args_info)) == 3  # w, x, kv: neither `unused` nor the pool
    got = part(params, state, x)
    assert got[0]["pool"] is state["pool"] and got[2] is state["count"] and got[0]["empty"] is None
    assert not state["pool"].is_deleted() and state["kv"].is_deleted()  # kv was donated, the pool was not
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    shapes = part.args_info[0]  # the original arguments' shapes, as a Compiled's args_info gives them
    assert shapes[1]["pool"].shape == (4,) and shapes[0][1].shape == (5,)


def test_a_slim_part_keeps_the_output_shardings_asked_for():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    split, whole = NamedSharding(mesh, P("tp")), NamedSharding(mesh, P())
    params, state, x = args()
    state = {**state, "kv": jax.device_put(jnp.ones(4), split)}
    params = (jnp.ones((3, 4)), params[1])

    lowered = slim_part.lower(step, (params, state, x), donate_argnums=(1,),
                              out_shardings=({"kv": split, "pool": whole, "empty": None}, whole, whole))
    got = lowered.compile()(params, state, x)
    assert got[0]["kv"].sharding.is_equivalent_to(split, 1)
    np.testing.assert_array_equal(np.asarray(got[0]["kv"]), 1 + np.arange(3.0).sum())


def test_a_slim_part_survives_the_executable_cache(tmp_path, compiled_here):
    params, state, x = args()
    hits = executable_cache.xla_cache_hits()
    part = slim_part.lower(step, (params, state, x), donate_argnums=(1,), out_shardings=None).compile()
    assert executable_cache.xla_cache_hits() == hits  # compiled, not served
    cache = ExecutableCache(str(tmp_path), "test")
    cache.store("k", [part])
    (loaded,) = cache.load("k", jax.devices()[:1])
    assert isinstance(loaded, slim_part.SlimPart) and loaded.plan == part.plan
    want = part(*args())
    got = loaded(*args())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_slim_part_refuses_arguments_of_another_shape():
    params, state, x = args()
    part = slim_part.lower(step, (params, state, x), donate_argnums=(1,), out_shardings=None).compile()
    with pytest.raises(TypeError, match="takes 3 arguments"):
        part(params, state)
    with pytest.raises(TypeError, match="takes 6 arrays"):
        part(params, {**state, "extra": jnp.ones(1)}, x)
