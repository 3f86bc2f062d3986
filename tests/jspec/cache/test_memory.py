"""Pool sizing from the device's memory (SGLang's mem_fraction_static), on the CPU with the
device's memory statistics stood in: the arithmetic, the error, and an engine sized by it."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jspec import Engine
from jspec.cache import memory
from jspec.cache.memory import PAGE_STEPS, DeviceMemory, plan_pages, round_pages
from jspec.errors import ConfigError
from jspec.models.loader import load_model
from jspec.tiny import tiny_dir

GiB = 1 << 30


def test_pages_take_what_the_static_share_leaves():
    plan = plan_pages(DeviceMemory(bytes_limit=80 * GiB, bytes_in_use=16 * GiB), mem_fraction_static=0.9,
                      page_bytes=2 << 20, fixed_bytes=GiB, workspace_bytes=3 * GiB, min_pages=3, page_size=16)
    fits = (int(0.9 * 80 * GiB) - 16 * GiB - 3 * GiB - GiB) // (2 << 20)
    assert fits * (1 - 1 / PAGE_STEPS) <= plan.num_pages <= fits
    assert plan.resident_bytes == 16 * GiB and plan.workspace_bytes == 3 * GiB


def test_a_few_mib_more_in_use_keeps_the_page_count():
    """A restarted engine finds a few MiB more or less in use; its pool, and so every compiled step's
    shapes, must stay the same or the persistent caches miss. The first start's count sits just on
    a step (the worst case for rounding alone); later starts keep it while it fits."""
    def plan(drift, previous=None):
        return plan_pages(DeviceMemory(bytes_limit=80 * GiB, bytes_in_use=16 * GiB + drift), mem_fraction_static=0.9,
                          page_bytes=2 << 20, fixed_bytes=GiB, workspace_bytes=3 * GiB, min_pages=3, page_size=16,
                          previous=previous).num_pages
    first = plan(0)
    assert first == round_pages(first)
    assert plan(-(600 << 20)) > first  # 300 pages more fit: rounding alone gives one step more
    assert {plan(drift, previous=first) for drift in range(-(600 << 20), 1 << 20, 8 << 20)} == {first}
    assert plan(1 << 20, previous=first) < first  # no longer fits: the rounded count of what does
    assert plan(-(4 * GiB), previous=first) > first  # much more room: not held back by the old count


def test_pages_round_down_by_at_most_a_step():
    for n in [1, 5, 64, 127, 128, 129, 1000, 25_001, 171_000, 1 << 20]:
        r = round_pages(n)
        assert n * (1 - 1 / PAGE_STEPS) <= r <= n
        assert round_pages(r) == r
    assert round_pages(1007) == 1000 and round_pages(1007, min_pages=1005) == 1005  # never below what the engine needs


class _Device:
    """A stand-in device: its platform and what its allocator reports."""

    def __init__(self, platform, stats):
        self.platform, self.local_hardware_id, self._stats = platform, 3, stats

    def memory_stats(self):
        return self._stats


def test_a_gpu_allocator_without_statistics_is_sized_from_the_driver(monkeypatch):
    """XLA's VMM allocator (SKIP_TEMP) reports no statistics: the driver's free / total stand in,
    with jspec's allocator share of the total as the limit and all that is held as in use (no live
    arrays on this device)."""
    monkeypatch.setattr(memory, "_OUTSIDE", {})
    asked = []
    monkeypatch.setattr(memory.driver_memory, "free_total", lambda ordinal: asked.append(ordinal) or (100 * GiB, 140 * GiB))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    assert memory.device_memory(_Device("gpu", None)) == DeviceMemory(int(0.92 * 140 * GiB), 40 * GiB)
    assert asked == [3]  # the device's own ordinal
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    assert memory.device_memory(_Device("gpu", {})) == DeviceMemory(70 * GiB, 40 * GiB)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.25")  # jaxlib's newer name for the share
    assert memory.device_memory(_Device("gpu", {})) == DeviceMemory(35 * GiB, 40 * GiB)
    # An allocator with statistics is read as before; no driver and no limit leave the engine's limits.
    assert memory.device_memory(_Device("gpu", {"bytes_limit": 8 * GiB, "bytes_in_use": GiB})) == DeviceMemory(8 * GiB, GiB)
    assert memory.device_memory(_Device("cpu", None)) is None
    monkeypatch.setattr(memory.driver_memory, "free_total", lambda ordinal: None)
    assert memory.device_memory(_Device("gpu", None)) is None


def test_memory_the_vmm_allocator_keeps_mapped_is_not_in_use(monkeypatch):
    """XLA's VMM allocator keeps freed memory mapped for reuse (freed temporaries, a shut-down
    engine's pool), and the driver counts it as held: in use is what lies outside the allocator,
    as first seen before any weights, plus the live arrays, so a second engine in the process is
    sized as the first was."""
    monkeypatch.setattr(memory, "_OUTSIDE", {})
    seen = {"driver": 2 * GiB, "live": 0}
    monkeypatch.setattr(memory.driver_memory, "free_total", lambda ordinal: (140 * GiB - seen["driver"], 140 * GiB))
    monkeypatch.setattr(memory, "live_bytes", lambda device: seen["live"])
    dev = _Device("gpu", None)
    assert memory.device_memory(dev).bytes_in_use == 2 * GiB  # engine configuration: the context only
    seen.update(driver=26 * GiB, live=16 * GiB)  # weights live; 8 GiB of the loader's temporaries kept mapped
    assert memory.device_memory(dev).bytes_in_use == 18 * GiB
    seen.update(driver=120 * GiB, live=0)  # the engine shut down; its pool is still mapped
    assert memory.device_memory(dev).bytes_in_use == 2 * GiB
    seen.update(driver=3 * GiB, live=2 * GiB)  # never more than the driver's count says
    assert memory.device_memory(dev).bytes_in_use == 3 * GiB
    other = _Device("gpu", None)
    other.local_hardware_id = 4  # each device keeps its own first look
    seen.update(driver=30 * GiB, live=0)
    assert memory.device_memory(other).bytes_in_use == 30 * GiB


def test_live_bytes_are_the_arrays_on_the_device():
    cpu = jax.devices("cpu")[0]
    before = memory.live_bytes(cpu)
    x = jax.device_put(np.zeros((1000,), np.float32), cpu)
    assert memory.live_bytes(cpu) == before + 4000
    assert memory.live_bytes(_Device("gpu", None)) == 0  # nothing lives on another device
    del x
    assert memory.live_bytes(cpu) == before


def test_the_driver_query_is_none_without_cuda(monkeypatch):
    """Where libcuda is missing the query answers None, not an error; where it is there (or a
    driver call fails, as it does without a GPU) the answer is None or a sane pair."""
    held = memory.driver_memory.free_total(0)
    assert held is None or 0 <= held[0] <= held[1]

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(memory.driver_memory.ctypes, "CDLL", missing)
    assert memory.driver_memory.free_total(0) is None


def test_too_little_memory_names_the_knob():
    with pytest.raises(ConfigError, match=r"mem_fraction_static=0\.5 .*room for 0 KV pages.*Raise mem_fraction_static"):
        plan_pages(DeviceMemory(bytes_limit=80 * GiB, bytes_in_use=39 * GiB), mem_fraction_static=0.5,
                   page_bytes=2 << 20, fixed_bytes=GiB, workspace_bytes=GiB, min_pages=3, page_size=16)
    with pytest.raises(ConfigError, match="mem_fraction_static must be in"):
        plan_pages(DeviceMemory(GiB, 0), mem_fraction_static=1.5, page_bytes=1, fixed_bytes=0, workspace_bytes=0,
                   min_pages=1, page_size=16)


SETTINGS = dict(dtype="float32", cuda_graph_bs=[1, 2], max_running_requests=2, chunked_prefill_size=32,
                context_length=96, show_progress=False, compilation_cache_dir="none")


@pytest.fixture(scope="module")
def model():
    return load_model(tiny_dir("qwen3"), dtype="float32")


def _fake_device(monkeypatch, limit: int, in_use: int) -> None:
    monkeypatch.setattr(memory, "device_memory", lambda device=None: DeviceMemory(limit, in_use))


def test_engine_pool_is_sized_from_device_memory(monkeypatch, model):
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    _fake_device(monkeypatch, limit=256 << 20, in_use=weights)
    with Engine(model, mem_fraction_static=0.5, **SETTINGS) as eng:
        info = eng.get_server_info()
        mem, plan = info["memory"], eng.engine_config.memory_plan
        assert mem["workspace_bytes"] > 0  # measured by compiling the largest buckets
        assert mem["resident_bytes"] == weights and mem["weights_bytes"] == weights
        # The plan's per-page and fixed bytes are the real pools' bytes, to the byte.
        assert mem["kv_pool_bytes"] + mem["state_pool_bytes"] == plan.fixed_bytes + plan.page_bytes * plan.num_pages
        static = weights + mem["workspace_bytes"] + mem["kv_pool_bytes"] + mem["state_pool_bytes"]
        fits = (int(0.5 * (256 << 20)) - static) // plan.page_bytes + plan.num_pages  # before rounding
        assert static <= 0.5 * (256 << 20) and plan.num_pages == round_pages(fits, eng.engine_config.layout.min_pages)
        assert info["num_total_pages"] == plan.num_pages - 1
        assert info["max_total_tokens"] == (plan.num_pages - 1) * 16
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(out["output_ids"]) == 3


def test_engine_that_does_not_fit_says_how_much_it_needs(monkeypatch, model):
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    _fake_device(monkeypatch, limit=weights, in_use=weights)
    with pytest.raises(ConfigError, match="mem_fraction_static=0.88 .* GiB in all"):
        Engine(model, **SETTINGS)


def test_max_total_tokens_overrides_device_memory(monkeypatch, model):
    _fake_device(monkeypatch, limit=1, in_use=1)
    with Engine(model, max_total_tokens=320, **SETTINGS) as eng:
        assert eng.get_server_info()["num_total_pages"] == 20
        assert eng.engine_config.memory_plan is None


@pytest.mark.parametrize("preset, share, allocator", [
    ({}, "0.92", None), ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, "0.5", None),
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, None, None), ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, None, None),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, None, "platform"), ({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"}, "0.92", "vmm"),
    ({"JSPEC_GRAMMAR_UPDATE_MODE": "SKIP_TEMP"}, "0.92", "vmm"),
    ({"JSPEC_GRAMMAR_UPDATE_MODE": "SKIP_TEMP", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, None, "platform")])
def test_import_sizes_the_allocator_unless_the_user_did(preset, share, allocator):
    # mem_fraction_static is a share of the allocator's limit, so JAX's 75% default would leave a
    # quarter of every GPU unused; importing jspec takes 92% unless an allocator setting is given.
    # jaxlib refuses both names of the share at once, so a share under the newer name is left alone;
    # the VMM allocator takes the share as its budget. The grammar update mode needs that allocator,
    # so it selects it, unless the user chose another.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XLA_PYTHON_CLIENT_", "XLA_CLIENT_", "JSPEC_GRAMMAR_UPDATE_MODE"))} | preset
    code = "import os, jspec; print([os.environ.get(f'XLA_PYTHON_CLIENT_{k}') for k in ('MEM_FRACTION', 'ALLOCATOR')])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([share, allocator])
