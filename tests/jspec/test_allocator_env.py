"""allocator_env.choose_for_grammar: an engine with a grammar backend selects the constrained steps'
graph update mode (and the VMM allocator that honours it) only where that is safe: a CUDA machine,
no JAX client yet, one device, nothing of it chosen by the user. The import-time share and the
mode's allocator: tests/jspec/cache/test_memory.py."""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

from jspec import allocator_env
from jspec.allocator_env import ALLOCATOR, GRAMMAR_UPDATE_MODE, UPDATE_MODE_ENV, choose_for_grammar


@pytest.fixture
def fresh_cuda(monkeypatch):
    """A process as on a GPU machine before its first device use, with none of the settings given."""
    for k in (UPDATE_MODE_ENV, ALLOCATOR, "XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(k, "")  # recorded, so that what the test's calls set is undone after it
        monkeypatch.delenv(k)
    monkeypatch.setattr(allocator_env, "_client_exists", lambda: False)
    monkeypatch.setattr(allocator_env, "_cuda_machine", lambda: True)
    return monkeypatch


def _chosen() -> tuple:
    return os.environ.get(UPDATE_MODE_ENV), os.environ.get(ALLOCATOR)


def test_a_grammar_engine_on_a_fresh_cuda_process_selects_the_mode_and_its_allocator(fresh_cuda):
    assert choose_for_grammar("llguidance", None)
    assert _chosen() == (GRAMMAR_UPDATE_MODE, "vmm")


def test_one_device_given_explicitly_counts_as_the_default(fresh_cuda):
    assert choose_for_grammar("llguidance", 1) and _chosen() == (GRAMMAR_UPDATE_MODE, "vmm")


@pytest.mark.parametrize("backend, tp, setting", [
    (None, None, None), ("none", None, None),  # no grammar backend
    ("llguidance", 2, None),  # tensor parallelism: not measured under the VMM allocator
    ("llguidance", None, (UPDATE_MODE_ENV, "")),  # the user keeps XLA's default mode
    ("llguidance", None, (UPDATE_MODE_ENV, "SKIP_PROFILED")),  # or names another
    ("llguidance", None, (ALLOCATOR, "platform")),  # the user's allocator
    ("llguidance", None, ("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP")),  # XLA's own flag
])
def test_nothing_is_chosen_where_the_user_or_the_engine_decides_otherwise(fresh_cuda, backend, tp, setting):
    if setting is not None:
        fresh_cuda.setenv(*setting)
    before = _chosen()
    assert not choose_for_grammar(backend, tp)
    assert _chosen() == before


@pytest.mark.parametrize("client, cuda", [(True, True), (False, False)])
def test_nothing_is_chosen_once_a_client_exists_or_off_cuda(fresh_cuda, client, cuda):
    # Once JAX's client exists its allocator is fixed: a mode set then would name an allocator
    # the process does not run. Off CUDA there is nothing to choose.
    fresh_cuda.setattr(allocator_env, "_client_exists", lambda: client)
    fresh_cuda.setattr(allocator_env, "_cuda_machine", lambda: cuda)
    assert not choose_for_grammar("llguidance", None)
    assert _chosen() == (None, None)


def test_a_cuda_machine_is_one_with_a_cuda_plugin_that_jax_platforms_allows(monkeypatch):
    real = importlib.util.find_spec
    plugin = "jax_cuda12_plugin"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == plugin else real(name, *a))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert allocator_env._cuda_machine()
    for platforms, cuda in (("cuda", True), ("cuda,cpu", True), ("gpu", True), ("cpu", False), ("tpu", False)):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert allocator_env._cuda_machine() == cuda, platforms
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "cuda" in name else real(name, *a))
    assert not allocator_env._cuda_machine()


def test_this_process_client_is_seen(monkeypatch):
    import jax
    from jax._src import xla_bridge

    jax.devices()  # the test process's client exists from here on
    assert allocator_env._client_exists() and xla_bridge.backends_are_initialized()
    monkeypatch.delattr(xla_bridge, "backends_are_initialized")  # a JAX without the query: assume one
    assert allocator_env._client_exists()


def test_the_cli_and_engine_config_choose_before_their_command_runs(monkeypatch):
    """`jspec` commands choose right after parsing (a benchmark's random weights and record touch
    the device before any engine exists); EngineConfig.create does too, for Python callers."""
    import jspec.cli as cli
    from jspec.engine_config import EngineConfig
    from jspec.tiny import tiny_dir

    calls = []
    monkeypatch.setattr(allocator_env, "choose_for_grammar", lambda *a: calls.append(("choose", *a)))

    class Parser:
        def parse_args(self, argv):
            return argparse.Namespace(command="x", grammar_backend="llguidance", tp_size=None,
                                      func=lambda args: calls.append(("run",)) or 0)

    monkeypatch.setattr(cli, "build_parser", lambda: Parser())
    assert cli.main([]) == 0
    assert calls == [("choose", "llguidance", None), ("run",)]
    calls.clear()
    EngineConfig.create(tiny_dir("qwen3"), grammar_backend="llguidance", tp_size=1)
    assert calls == [("choose", "llguidance", 1)]
