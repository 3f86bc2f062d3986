"""The one-shot all-reduce kernel: its argument checks everywhere, its sums on 2+ GPUs.

The kernel reads peers' memory, which neither the CPU backend nor Pallas' interpret mode can run,
so the sum is checked on a GPU machine (also by `bench/allreduce.py`, which compares it with psum).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.all_reduce import one_shot_all_reduce


def test_rejects_a_size_that_does_not_split_into_tiles():
    with pytest.raises(ValueError, match="1000 elements"):
        one_shot_all_reduce(jnp.zeros((1000,), jnp.bfloat16), "tp", 2)
    with pytest.raises(ValueError, match="tiles of 3000"):
        one_shot_all_reduce(jnp.zeros((6000,), jnp.bfloat16), "tp", 2, tile=3000)


@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                    reason="reads peer GPU memory: needs 2 or more GPUs")
@pytest.mark.parametrize("cols", [4096, 4096 * 32 + 4096])
def test_equals_psum_on_gpus(cols):
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    x = jax.random.normal(jax.random.key(0), (n, cols), jnp.bfloat16)

    def run(reduce):
        return jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                                     check_vma=False))(x)

    got = run(lambda a: one_shot_all_reduce(a, "tp", n))
    want = jnp.sum(x.astype(jnp.float32), axis=0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.broadcast_to(np.asarray(want, np.float32), got.shape))
