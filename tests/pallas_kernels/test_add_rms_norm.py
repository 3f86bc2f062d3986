"""The residual add + RMSNorm kernel (interpret mode) against the reference's two steps: bit for
bit in bf16, within float32 rounding of the sum of squares in float32; widths that are not powers
of two (masked lanes), zero-centred weights, no delta (the first layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rms_norm import add_rms_norm
from pallas_kernels.rms_norm import reference as ref


@pytest.mark.parametrize("tokens,width,dtype,zero_centred", [
    (3, 64, jnp.bfloat16, False),
    (5, 96, jnp.bfloat16, False),  # not a power of two: masked lanes must not enter the sum
    (2, 128, jnp.bfloat16, True),
    (4, 64, jnp.float32, False),
])
def test_add_rms_norm_matches_reference(tokens, width, dtype, zero_centred):
    rng = np.random.default_rng(width)
    x = jnp.asarray(rng.standard_normal((tokens, width)) * 3, dtype)
    delta = jnp.asarray(rng.standard_normal((tokens, width)), dtype)
    w = jnp.asarray(rng.standard_normal(width) * 0.2 + (0.0 if zero_centred else 1.0), dtype)
    kw = dict(eps=1e-6, zero_centred=zero_centred)
    want = ref.add_rms_norm(x, delta, w, **kw)
    got = jax.jit(lambda *a: add_rms_norm(*a, **kw, interpret=True))(x, delta, w)
    for name, g, e in zip(("residual", "normed"), got, want):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        g, e = np.asarray(g.astype(jnp.float32)), np.asarray(e.astype(jnp.float32))
        if dtype == jnp.float32:
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(g, e, err_msg=name)


def test_rms_norm_without_delta_returns_x_as_the_residual():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(96) * 0.2 + 1.0, jnp.bfloat16)
    res, normed = jax.jit(lambda x, w: add_rms_norm(x, None, w, eps=1e-6, zero_centred=False, interpret=True))(x, w)
    want_res, want_normed = ref.add_rms_norm(x, None, w, eps=1e-6, zero_centred=False)
    np.testing.assert_array_equal(np.asarray(res, np.float32), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(want_res, np.float32), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32))


def test_add_rms_norm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"weight \(8,\)"):
        add_rms_norm(jnp.zeros((2, 4)), jnp.zeros((2, 4)), jnp.zeros(8), eps=1e-6, zero_centred=False, interpret=True)
