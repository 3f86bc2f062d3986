"""GPU check: ops.top_k (the kernel, threshold on) with and without a row mask equals lax.top_k."""
import jax, jax.numpy as jnp, numpy as np
from jspec.models import ops
for rows in (1, 7, 32, 512):
    for k in (5, 20):
        x = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(rows * k), (rows, 151936)) * 3)
        x = x.at[:, ::1000].set(x.max())  # ties across blocks
        want = jnp.arange(rows) % 3 != 1
        v, i = jax.jit(lambda x, w: ops.top_k(x, k, w))(x, want)
        v0, i0 = jax.jit(lambda x: ops.top_k(x, k))(x)
        rv, ri = jax.lax.top_k(x, k)
        m = np.asarray(want)
        assert (np.asarray(i0) == np.asarray(ri)).all() and (np.asarray(v0) == np.asarray(rv)).all(), (rows, k)
        assert (np.asarray(i)[m] == np.asarray(ri)[m]).all() and (np.asarray(v)[m] == np.asarray(rv)[m]).all()
        assert not np.asarray(i)[~m].any() and not np.asarray(v)[~m].any()
print("top_k check ok")
