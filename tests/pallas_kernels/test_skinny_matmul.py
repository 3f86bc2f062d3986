"""The skinny matmul kernel (interpret mode) against its oracle: row counts below, at and past the
16-row tensor-core tile, one split (rounded in the kernel) and several (float32 partials summed
after), and shapes its launch-shape chooser must refuse."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.skinny_matmul import Config, choose, skinny_matmul
from pallas_kernels.skinny_matmul import reference as ref


@pytest.mark.parametrize("m, n, k, cfg", [
    (1, 64, 256, Config(32, 64, 1)),
    (5, 128, 512, Config(32, 64, 2)),
    (16, 64, 256, Config(64, 64, 1)),
    (33, 96, 384, Config(32, 64, 3)),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_the_oracle(m, n, k, cfg, dtype):
    rng = np.random.default_rng(m * n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, dtype)
    y = skinny_matmul(x, w, cfg=cfg, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    expect = np.asarray(ref.skinny_matmul(x, w), np.float32)
    # float32: summation order only; bf16: one rounding of the output either way (an ulp apart).
    tol = 1e-4 if dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(np.asarray(y, np.float32), expect, rtol=tol, atol=tol)


def test_choose_splits_k_when_columns_leave_sms_idle():
    cfg = choose(4096, 4096, block_n=64, block_k=128, programs_per_sm=2)
    assert cfg.block_n == 64 and (4096 // 64) * cfg.splits >= 2 * 132 and 4096 // cfg.splits >= 2 * cfg.block_k
    assert choose(151936, 4096).splits == 1  # an lm_head has programs enough


def test_refuses_what_it_cannot_tile():
    x, w = jnp.zeros((2, 96)), jnp.zeros((64, 96))
    with pytest.raises(ValueError, match="does not tile"):
        skinny_matmul(x, w, cfg=Config(64, 64, 1), interpret=True)
    with pytest.raises(ValueError, match="K=96 columns"):
        skinny_matmul(jnp.zeros((2, 96)), jnp.zeros((64, 128)), interpret=True)
