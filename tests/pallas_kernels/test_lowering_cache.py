"""The Triton lowering memo (`pallas_kernels.lowering_cache`): modules lowered for CUDA (on any
machine) are the same text with and without it, a kernel repeated across modules is lowered once,
and kernels that differ in anything they are lowered from are not mixed up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import lowering_cache
from pallas_kernels.rms_norm.kernel import add_rms_norm


def _module(rows: int, eps: float = 1e-6, num_warps: int = 4) -> str:
    def f(x, d, w):
        y, r = add_rms_norm(x, d, w, eps=eps, zero_centred=False, num_warps=num_warps)
        return add_rms_norm(y, r, w, eps=eps, zero_centred=False, num_warps=num_warps)

    args = (jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16), jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((256,), jnp.bfloat16))
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def plain(monkeypatch):
    """Module texts lowered by JAX alone (the memo off for the calls inside)."""
    monkeypatch.setattr(lowering_cache, "_memo", _Refusing())
    return {k: _module(*k) for k in ((8,), (16,), (8, 1e-5), (8, 1e-6, 8))}


class _Refusing(dict):
    """A memo that never holds anything: every lowering runs."""

    def setdefault(self, key, value):
        return value


def test_memoized_modules_equal_jax_own_and_repeats_are_lowered_once(plain, monkeypatch):
    assert lowering_cache.install()
    monkeypatch.undo()  # the real memo again
    lowering_cache.take()
    assert _module(8) == plain[(8,)]
    assert lowering_cache.take() == {"hits": 1, "misses": 1, "uncached": 0}  # the module's second norm reuses the first's
    assert _module(8) == plain[(8,)] and _module(8) == plain[(8,)]
    assert lowering_cache.take() == {"hits": 3, "misses": 1, "uncached": 0}  # the second module lowers nothing
    # Another row count, epsilon or warp count is another kernel: its own lowering, JAX's text.
    assert _module(16) == plain[(16,)]
    assert _module(8, 1e-5) == plain[(8, 1e-5)]
    assert _module(8, 1e-6, 8) == plain[(8, 1e-6, 8)]
    assert _module(8) == plain[(8,)]
    lowering_cache.take()


def test_install_is_idempotent_and_the_environment_turns_it_off(monkeypatch):
    from jax._src.pallas.triton import pallas_call_registration as registration

    assert lowering_cache.install() and lowering_cache.install()
    lower = registration.lowering.lower_jaxpr_to_triton_module
    assert lower.jspec_memoized and not getattr(lower.__wrapped__, "jspec_memoized", False)
    monkeypatch.setenv(lowering_cache.ENV, "0")
    assert not lowering_cache.install()


def test_the_memo_keys_whatever_arguments_the_lowering_names(monkeypatch):
    """Older and newer jax name the Triton lowering's arguments differently: the memo binds them to
    the wrapped function's own signature, and a call it cannot bind goes to JAX unmemoized."""
    monkeypatch.setattr(lowering_cache, "_memo", {})
    calls = []

    def lower(jaxpr, grid_mapping, name_and_src_info, platform):
        calls.append((grid_mapping, platform))
        return object()

    memo = lowering_cache._memoized(lower)
    jaxpr = jax.make_jaxpr(lambda x: x + 1)(1.0).jaxpr
    first = memo(jaxpr, "grid (2,)", "kernel", platform="cuda")
    assert memo(jaxpr, "grid (2,)", "kernel", "cuda") is first and len(calls) == 1
    assert memo(jaxpr, "grid (4,)", "kernel", "cuda") is not first and len(calls) == 2
    with pytest.raises(TypeError):
        memo(jaxpr, "grid (2,)")  # unbindable: JAX's function itself is called, and refuses
    assert len(calls) == 2
