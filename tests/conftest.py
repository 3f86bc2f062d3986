"""Test-session settings that must be in place before JAX starts its CPU backend.

Most of the suite's time is XLA compiling the tiny models' step functions. Two compiler flags, set
for the tests only, cut that. The programs JAX hands to XLA are unchanged; only how XLA turns them
into CPU code changes (results may differ in float rounding, as between XLA versions; every test
still passes):
- `--xla_backend_optimization_level=0`: no LLVM optimisation of the generated CPU code (the
  tests' tiny models run little code; `jspec demo`, which runs much, keeps the caller's flags);
- `--xla_cpu_use_fusion_emitters=false`: XLA's classic emitters for CPU fusions.
- `--xla_force_host_platform_device_count=4`: four CPU devices, for the tensor-parallel tests
  (a mesh of 2 or 4); everything else runs on the first, as before.
A persistent compilation cache shared by the session does not pay: the test files' tiny models
differ, so almost no compile would hit it. Timings: bench/README.md, "Test suite timing".

The compiled-step cache (`jspec.runtime.executable_cache`) is off for the suite
(`JSPEC_EXECUTABLE_CACHE=0`): every engine traces its own steps, and an engine built without
`compilation_cache_dir` cannot load steps another test run left in the user's cache. Its own tests
turn it on.

Engines that name no `compilation_cache_dir` (and the `jspec serve` / `jspec bench` subprocesses)
use a cache folder of this test process (`JSPEC_COMPILATION_CACHE`), not the user's
~/.cache/jspec: a test run neither writes into the user's cache nor runs faster because an earlier
run warmed it.

Flags the caller already set in XLA_FLAGS come last and so win. Subprocesses inherit the test
flags; the one that runs `jspec demo` as a user would gets the caller's own (`JSPEC_USER_XLA_FLAGS`),
because its 10 engines generate enough tokens that unoptimised code costs more than it saves.
"""

import atexit
import os
import shutil
import tempfile

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JSPEC_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ['JSPEC_USER_XLA_FLAGS']}".strip()
os.environ["JSPEC_EXECUTABLE_CACHE"] = "0"
os.environ["JSPEC_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jspec-test-xla-")
atexit.register(shutil.rmtree, os.environ["JSPEC_COMPILATION_CACHE"], ignore_errors=True)

# ----------------------------------------------------------------------------- shared fixtures
# Imported after the flags above (none of these modules starts JAX, but keep it that way).
import json  # noqa: E402

import pytest  # noqa: E402

from tests.support import models as tm  # noqa: E402
from tests.support import spec_chain  # noqa: E402
from tests.support.engines import SPEC_BS4, plain_greedy  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Tiny random checkpoints built once per session (per xdist worker) and read by every file
    that asks for the same one: `tiny_checkpoint(name, seed)` is its directory,
    `tiny_checkpoint.hf(name, seed)` the transformers model. Tests must not write into them."""
    return tm.TinyCheckpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def greedy_reference():
    """`greedy_reference(target, prompts, sampling_params, page_size=, settings=, engine=None)`: a
    plain engine's outputs, computed once per session for each target, prompts, sampling
    parameters, page size and settings. engine: a running plain engine of that target and those
    settings to compute them with (one compile less)."""
    cache: dict = {}

    def get(target, prompts, sampling_params, *, page_size, settings, engine=None):
        key = (target, page_size, json.dumps([prompts, sampling_params, settings], sort_keys=True))
        if key not in cache:
            cache[key] = plain_greedy(target, prompts, sampling_params, page_size=page_size, settings=settings,
                                      engine=engine)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def chain_dirs(tiny_checkpoint):
    """(target, draft) directories of the chain speculative tests (STANDALONE and NGRAM)."""
    return tiny_checkpoint(*spec_chain.TARGET), tiny_checkpoint(*spec_chain.DRAFT)


@pytest.fixture(scope="session")
def chain_reference(chain_dirs, greedy_reference):
    """Non-speculative greedy outputs of the chain tests' PROMPTS. The oracle engine compiles one
    decode batch size (shorter batches run padded, CI time): a plain engine's batch-size buckets
    and its parity with transformers are test_engine.py's business."""
    return greedy_reference(chain_dirs[0], spec_chain.PROMPTS, spec_chain.GREEDY, page_size=16, settings=SPEC_BS4)
