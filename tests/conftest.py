"""Test-session settings that must be in place before JAX starts its CPU backend.

Most of the suite's time is XLA compiling the tiny models' step functions. Two compiler flags, set
for the tests only, cut that. The programs JAX hands to XLA are unchanged; only how XLA turns them
into CPU code changes (results may differ in float rounding, as between XLA versions; every test
still passes):
- `--xla_backend_optimization_level=1`: LLVM's -O1 instead of -O2 for the generated CPU code;
- `--xla_cpu_use_fusion_emitters=false`: XLA's classic emitters for CPU fusions.
Level 0 compiles faster still but makes generated code much slower (`jspec demo`). A persistent
compilation cache shared by the session does not pay: the test files' tiny models differ, so almost
no compile would hit it. Timings: bench/README.md, "Test suite timing".

Flags the caller already set in XLA_FLAGS come last and so win. Subprocesses inherit the test
flags; the one that runs `jspec demo` as a user would gets the caller's own (`JSPEC_USER_XLA_FLAGS`),
because its 10 engines generate enough tokens that -O1 code costs more than it saves.
"""

import os

TEST_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JSPEC_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ['JSPEC_USER_XLA_FLAGS']}".strip()
