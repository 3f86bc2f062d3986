"""Test-session settings that must be in place before JAX starts its CPU backend.

Most of the suite's time is XLA compiling the tiny models' step functions (18 step compiles of one
hybrid spec test: 59 s of compile in a 69 s test). Two compiler flags, set for the tests only,
cut that. The programs JAX hands to XLA are unchanged; only how XLA turns them into CPU code
changes (results may differ in float rounding, as between XLA versions; every test still passes):
- `--xla_backend_optimization_level=1`: LLVM's -O1 instead of -O2 for the generated CPU code;
- `--xla_cpu_use_fusion_emitters=false`: XLA's classic emitters for CPU fusions.
Measured on the 2-core CI machine, one process: the NAIVE_EAGLE hybrid test's compile time 59 ->
41 s, and the training + sampling-distribution tests (tests/train/test_train_lm.py -k
loss_goes_down, tests/jspec/test_spec_ngram.py -k distribution, where generated code runs the
most) 113 -> 81 s of wall time. Over the whole suite (-n 2, 2026-11-22) the saving is smaller: 46.9
-> 44.2 CPU minutes, because several tests run long generated code. Level 0 compiles faster still
but made `jspec demo` generate 2-4x slower. A persistent compilation cache shared by the session was
tried too: the test files' tiny models differ, so 2 of 77 compiles hit it and it cost more than it
saved.

Flags the caller already set in XLA_FLAGS come last and so win. Subprocesses inherit the test
flags; the one that runs `jspec demo` as a user would gets the caller's own (`JSPEC_USER_XLA_FLAGS`),
because its 10 engines generate enough tokens that -O1 code costs more than it saves (measured:
240 s with the default flags, 289 s with these).
"""

import os

TEST_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JSPEC_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ['JSPEC_USER_XLA_FLAGS']}".strip()
