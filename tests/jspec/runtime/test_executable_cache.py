"""The compiled-step cache: a warm start loads every bucket instead of tracing it and serves the
same tokens; a change to the code or to a setting that shapes the steps misses; a damaged entry is
compiled again."""

import glob
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jspec.api import Engine
from jspec.cache import memory
from jspec.cache.memory import DeviceMemory
from jspec.models import ops
from jspec.models.loader import load_model
from jspec.runtime import executable_cache
from jspec.tiny import tiny_dir
from tests.support.engines import SPEC_BS4, output_ids

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
SETTINGS = {**SPEC_BS4, "speculative_algorithm": "EAGLE3", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 3, "speculative_draft_model_path": tiny_dir("qwen3-eagle3")}


def run(cache_dir, **overrides):
    """(outputs, hits, misses, buckets) of a fresh engine on cache_dir."""
    with Engine(tiny_dir("qwen3"), **{**SETTINGS, "compilation_cache_dir": str(cache_dir), **overrides}) as eng:
        outs = output_ids(eng.generate(input_ids=PROMPTS, sampling_params=GREEDY))
        cache = eng.get_server_info()["executable_cache"]
        return outs, cache["hits"], cache["misses"], len(eng.runner.buckets)


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A cold start on an empty cache: every bucket compiled and stored. XLA's own persistent cache
    is reopened in the same folder (the engine names it; the first compile opens it), as in a
    process that starts one engine."""
    mp = pytest.MonkeyPatch()
    mp.setenv("JSPEC_EXECUTABLE_CACHE", "1")
    cache_dir = tmp_path_factory.mktemp("xla")
    compilation_cache.reset_cache()
    try:
        outs, hits, misses, buckets = run(cache_dir)
        assert (hits, misses) == (0, buckets)
        entries = sorted(glob.glob(os.path.join(cache_dir, "executables", "*.jexe")))
        assert len(entries) == buckets
        yield cache_dir, outs, entries
    finally:
        mp.undo()
        compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def cache_on(monkeypatch):
    monkeypatch.setenv("JSPEC_EXECUTABLE_CACHE", "1")


def test_a_warm_start_loads_every_bucket_and_serves_the_same_tokens(cold):
    cache_dir, outs, entries = cold
    warm, hits, misses, buckets = run(cache_dir)
    assert buckets == len(entries)
    assert (hits, misses) == (buckets, 0)
    assert warm == outs


def test_a_setting_that_shapes_the_steps_misses(cold):
    cache_dir, _, _ = cold
    _, hits, misses, buckets = run(cache_dir, context_length=112)  # another page-table width
    assert hits == 0 and misses == buckets


def test_patched_code_changes_the_key(monkeypatch):
    before = executable_cache.code_digest()
    assert executable_cache.code_digest() == before
    monkeypatch.setattr(ops, "vocab_take", lambda x, ids, *, tp=1: x[..., :1])  # a patched function
    patched = executable_cache.code_digest()
    assert patched != before
    monkeypatch.undo()
    assert executable_cache.code_digest() == before
    monkeypatch.setattr(ops, "PREFILL_CUDNN_MIN_TOKENS", 1)  # a patched constant
    assert executable_cache.code_digest() != before


DIGEST_IN_A_NEW_PROCESS = """
import dataclasses
from jspec.models import ops
from jspec.runtime.executable_cache import code_digest
ops.is_known = lambda name: name in {"alpha", "beta", "gamma", "delta", "epsilon"}  # a frozenset constant
@dataclasses.dataclass(frozen=True)
class Frozen:  # Python 3.12 tests field names against a set literal in __setattr__
    alpha: int = 1
    beta: int = 2
    gamma: int = 3
Frozen.__module__ = ops.__name__
ops.Frozen = Frozen
print(code_digest())
"""


def test_the_key_is_the_same_in_every_process():
    """Set iteration order follows string hashes, which differ per process: the code digest must not
    (a restarted engine would miss every step)."""
    digests = {subprocess.run([sys.executable, "-c", DIGEST_IN_A_NEW_PROCESS], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2", "3")}
    assert len(digests) == 1


def test_the_key_does_not_depend_on_what_else_was_imported():
    """`jspec serve` imports the server (and a user's script whatever it likes) before the engine
    starts: the same steps must find the same entries as a bare `Engine(...)` does."""
    code = "{}\nfrom jspec.runtime.executable_cache import code_digest\nprint(code_digest())"
    digests = {subprocess.run([sys.executable, "-c", code.format(pre)], capture_output=True, text=True,
                              check=True).stdout
               for pre in ("", "import jspec.bench.record, jspec.server.stream_text, jspec.models.scoring")}
    assert len(digests) == 1


def test_a_damaged_entry_is_compiled_again(cold):
    """The step is compiled again, through XLA's cache here, which serves it: such a step is not
    stored (see the test below), so the damaged entry is dropped rather than read at every start."""
    cache_dir, outs, entries = cold
    buckets = len(entries)
    with open(entries[0], "wb") as f:
        f.write(b"not an executable")
    warm, hits, misses, _ = run(cache_dir)
    assert (hits, misses) == (buckets - 1, 1)
    assert warm == outs
    assert not os.path.exists(entries[0])
    warm, hits, misses, _ = run(cache_dir)
    assert (hits, misses) == (buckets - 1, 1) and warm == outs


def test_a_split_target_warm_start_runs_on_its_mesh(tmp_path):
    """At tp_size 2 the loaded steps run on the mesh's two devices (not on every visible one)."""
    plain = {k: None for k in SETTINGS if k.startswith("speculative_") and k != "speculative_adaptive"}
    plain["tp_size"] = 2
    cold, hits, misses, buckets = run(tmp_path, **plain)
    assert hits == 0
    warm, hits, misses, _ = run(tmp_path, **plain)
    assert (hits, misses) == (buckets, 0)
    assert warm == cold


def test_a_warm_start_sizes_the_pool_as_the_cold_one(monkeypatch, tmp_path):
    """Sizing the pool from device memory reads the workspace of the largest buckets' executables:
    loaded ones report the same bytes as compiled ones. The second start finds a little less in use,
    enough that what fits now rounds to one more step of pages: it keeps the first start's count, so
    its pool has the same shape and every step loads."""
    model = load_model(tiny_dir("qwen3"), dtype="float32")
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    in_use = [weights]
    monkeypatch.setattr(memory, "device_memory", lambda device=None: DeviceMemory(256 << 20, in_use[0]))
    small = dict(dtype="float32", cuda_graph_bs=[2], max_running_requests=2, chunked_prefill_size=32,
                 context_length=96, show_progress=False, compilation_cache_dir=str(tmp_path))
    runs = []
    for _ in range(2):
        with Engine(model, mem_fraction_static=0.5, **small) as eng:
            info = eng.get_server_info()
            plan = eng.engine_config.memory_plan
            runs.append((info["memory"]["workspace_bytes"], plan.num_pages, info["executable_cache"]))
            assert info["workspace_compile_seconds"] > 0  # the memory plan's compiles (or loads), timed
        # Free memory for the next start: what fits reaches the next multiple of the rounding step.
        static = int(0.5 * (256 << 20)) - plan.resident_bytes - plan.workspace_bytes - plan.fixed_bytes
        fits, step = static // plan.page_bytes, memory.page_step(plan.num_pages)
        in_use[0] -= (plan.num_pages + step - fits) * plan.page_bytes
        assert memory.round_pages(fits + (plan.num_pages + step - fits)) > plan.num_pages  # rounding alone would move
    assert runs[0][0] > 0 and runs[0][:2] == runs[1][:2]
    assert runs[0][2]["hits"] == 0 and runs[1][2]["misses"] == 0


def test_steps_that_xla_s_own_cache_served_are_not_stored(tmp_path):
    """After a code change the executable cache misses while XLA's persistent cache still holds the
    same programs. Re-serializing an executable JAX loaded from that cache gives, on CPU, a payload
    that loads and then fails at its first run ("Function ... not found"), so such steps are not
    stored: the next start goes through XLA's cache again and serves the same tokens. (GPU payloads
    survive the round trip and are stored: `stores_served`.)"""
    assert not executable_cache.stores_served("cpu") and executable_cache.stores_served("gpu")
    plain = {k: None for k in SETTINGS if k.startswith("speculative_") and k != "speculative_adaptive"}
    compilation_cache.reset_cache()  # XLA's cache in tmp_path: the engine names it, the first compile opens it
    try:
        cold, _, _, buckets = run(tmp_path, **plain)
        shutil.rmtree(tmp_path / "executables")  # as a code change would: every step misses here
        served, hits, misses, _ = run(tmp_path, **plain)
        assert (hits, misses) == (0, buckets)
        assert glob.glob(os.path.join(tmp_path, "executables", "*.jexe")) == []
        again, hits, _, _ = run(tmp_path, **plain)
        assert hits == 0 and served == cold and again == cold
    finally:
        compilation_cache.reset_cache()


def test_every_part_of_a_split_step_loads_from_a_mesh_s_device_iterator(tmp_path, compiled_here):
    """A split step stores several executables under one key, and the runner names its devices
    as `mesh.devices.flat`, an iterator: each part must get them all (the second part found none,
    so every grammar engine's split buckets compiled again at every start)."""
    cache = executable_cache.ExecutableCache(str(tmp_path), "test")
    x = jax.ShapeDtypeStruct((4,), jax.numpy.float32)
    parts = [jax.jit(f).lower(x).compile() for f in (lambda a: a + 1, lambda a: a * 2, lambda a: a - 3)]
    cache.store("split", parts)
    loaded = cache.load("split", np.array(jax.devices()[:1]).flat)
    assert loaded is not None and (cache.hits, cache.misses) == (1, 0)
    assert [float(p(jax.numpy.ones(4))[0]) for p in loaded] == [2.0, 2.0, -2.0]
