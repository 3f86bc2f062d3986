"""Fixtures shared by the runtime tests."""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache


@pytest.fixture
def compiled_here():
    """XLA's persistent cache off while the test compiles. An engine stores only the steps it
    compiled itself (`executable_cache.stores_served`): on CPU an executable that cache served, once
    serialized again, loads and then fails at its first run. An earlier test in this process may
    have turned that cache on and compiled the same program."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # whether the cache is used is decided once, at the first compile
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()
