"""XLA compiler options chosen per compiled step.

On a GPU, XLA lowers each matmul either to a cuBLAS call or to a Triton GEMM fusion, and picks the
Triton tiling by compiling and timing many candidate configurations (autotuning). For the skinny
matmuls of a decode step with few token rows the Triton fusions are faster; from about two dozen
rows cuBLAS is as fast or faster, and the Triton autotuning is most of such a step's compile time.
So a decode step whose target sees at least `CUBLAS_FROM_ROWS` token rows is compiled with Triton
GEMM fusions off (measurements: bench/README.md, "Start-up"), and with XLA's autotuning off
(`xla_gpu_autotune_level` 0), so that each cuBLAS call runs the algorithm cuBLAS's own heuristic
picks: XLA times the candidates one call at a time, and from one compile to the next it chose
algorithms that look fast alone but cost the captured step more (a memset before every call, or a
split-K reduce kernel after it); the heuristic's choice has fewer kernels and a faster step, and
the compile skips the timing (bench/README.md, "wide decode steps with XLA's autotuning off").

Prompt-chunk steps keep XLA's default unless `JSPEC_PROMPT_MATMULS=cublas`, which gives those of
at least `CUBLAS_FROM_ROWS` tokens the same cuBLAS heuristic (`autotune`, the default: XLA's
autotuned Triton GEMM fusions): their matmuls are compute-bound, where cuBLAS's heuristic is near
the device's peak, and skipping their autotuning shortens a cold start (bench/README.md, "prompt
steps' matmuls"), but the autotuned fusions ran long prompts slightly faster. A user who names
`xla_gpu_enable_triton_gemm` in XLA_FLAGS keeps that choice for every step.

XLA records a step's kernels into a CUDA graph (a command buffer) and launches the graph whole: the
host queues it in one call, which on the GPU machines measured takes milliseconds of host time for
a decode step, before the device starts on any of it. A step queued while the step before still
runs hides that. A grammar-constrained speculative step runs in parts (`split_step.py`), and which
of them compile without command buffers (kernels queued one by one, each starting at once) is
chosen per bucket (`default_uncaptured_parts`; bench/README.md, "Structured output"):
- without overlap, the verify part: the host launches it only after reading the drafts and
  walking the grammar, with the device idle;
- with overlap (pipelined: draft, forward, verify), none, at every width. The host launches the
  three parts one after another each step and must walk the grammar between the draft part and
  the verify part, so it is not far ahead of the device. Queued one kernel at a time the forward
  (most of the step's kernels) took the host as long as the device took to run it, and the
  verify part, which must follow it, waited for that launch to end; as a graph it is queued in
  one call and runs at the device's pace. With their carry in static buffers, shared
  by every chain length of a width, the parts' graphs are not re-recorded from step to step
  (bench/README.md, "the c32 constrained step after the shared arena").
A captured part's graph is re-recorded before a launch whenever a buffer it uses has moved; a
split step with any captured part therefore hands its carry over in static buffers
(`uses_static_carry`, `jspec.runtime.static_carry`).
Temporaries move too: each part's scratch buffer is allocated afresh at every launch. The
forward part's alternates between two addresses from step to step, so it runs as two loaded copies
taken in turn (`copied_parts`, `jspec.runtime.part_copies`), each of which keeps its graph.
`JSPEC_GRAMMAR_UPDATE_MODE=SKIP_TEMP` (any of XLA's `CommandBufferUpdateMode` names; jaxlib 0.11
or later for SKIP_TEMP) compiles the captured parts of constrained speculative split steps with
that command-buffer update mode, which keeps their temporaries at stable virtual addresses, so
their graphs are no longer re-recorded at every launch. XLA honours it only on a client running
its VMM allocator, which importing jspec selects when this variable is set (`jspec.allocator_env`).
That allocator serves the whole process: it reports no memory statistics (pools are sized from
the driver's figures and the live arrays, `jspec.cache.memory`) and nothing is preallocated.
Process-wide (XLA_FLAGS) the mode selects that allocator by itself and applies to every step,
which measured slower at concurrency 32 (bench/README.md, "XLA's command-buffer update modes on
the constrained step"). Unset by default: the switch would move the whole process, constrained or
not, onto that allocator, under which a grammar engine's unconstrained steps measured slower at
concurrency 1 and its constrained steps at 32 (bench/README.md, "the grammar engine choosing the
update mode itself"); TP is not measured under it. A user who names the mode in
XLA_FLAGS keeps that.
`JSPEC_GRAMMAR_PART_COPIES=draft,forward,verify` (any of them, or `none`) names exactly the parts of
every constrained split step that run as two copies on a GPU (a plain engine's split step: draft
is its forward, verify its sampling half); `JSPEC_GRAMMAR_FORWARD_COPIES=0` or `1` decides only
the forward's second copy, for every pipelined bucket on a GPU.
`JSPEC_GRAMMAR_UNCAPTURED_PARTS=draft,forward,verify` (any of the three, or `none`) names exactly
the parts of every constrained speculative split step, pipelined or not, that compile uncaptured,
in place of that choice (measured by `bench/grammar_cost.sh OUT graph-parts`). A user who names
`xla_gpu_enable_command_buffer` in XLA_FLAGS keeps that choice.

Split across GPUs, a step's all-reduces are by default XLA's own collective kernels, which end a
command buffer each. With `JSPEC_TP_GRAPH_COLLECTIVES_FROM_ROWS=N`, tensor-parallel decode steps of
at least N target rows are compiled with those kernels off and NCCL all-reduces recorded into the
graphs (`graph_collectives_options`); off by default: as XLA_FLAGS for a whole process it made a
wide TP2 step faster and a batch-1 step slower, and per bucket it made every step it applied to
slower (bench/README.md, "Tensor parallelism"). The knob stays for other hosts and models.
"""

from __future__ import annotations

import functools
import os
import re

from jspec.allocator_env import UPDATE_MODE_ENV
from jspec.errors import ConfigError
from jspec.models.batch import ForwardMode
from jspec.runtime.step_inputs import Bucket

CUBLAS_FROM_ROWS = 24
GRAPH_COLLECTIVES_ENV = "JSPEC_TP_GRAPH_COLLECTIVES_FROM_ROWS"
UNCAPTURED_PARTS_ENV = "JSPEC_GRAMMAR_UNCAPTURED_PARTS"
STATIC_CARRY_ENV = "JSPEC_GRAMMAR_STATIC_CARRY"
FORWARD_COPIES_ENV = "JSPEC_GRAMMAR_FORWARD_COPIES"
PART_COPIES_ENV = "JSPEC_GRAMMAR_PART_COPIES"
PROMPT_MATMULS_ENV = "JSPEC_PROMPT_MATMULS"
PROMPT_MATMULS = ("autotune", "cublas")
SPLIT_PARTS = ("draft", "forward", "verify")


def autotunes_matmuls(platform: str) -> bool:
    """Whether XLA times candidate kernels for a step's matmuls while compiling it on `platform`
    (and keeps the results in one cache per process, shared by every compile that follows)."""
    return platform == "gpu"


def target_rows(bucket: Bucket, drafting) -> int:
    """Token rows the target's matmuls see in one step of bucket: a speculative decode step
    verifies every request's drafted nodes, any other step has one row per token."""
    if bucket.mode is ForwardMode.EXTEND or drafting is None or not bucket.speculate:
        return bucket.num_tokens
    return bucket.batch_size * drafting.grammar_nodes(bucket.draft_steps)[0]


@functools.lru_cache(maxsize=None)
def _default_debug_options() -> str:
    # JAX's private compiler module (no public accessor for the default options), imported only by
    # the opt-in path that needs it, so a JAX that moves it breaks that knob and nothing else.
    from jax._src import compiler

    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    build = options.executable_build_options  # each a view into `options`: all kept alive while read
    return str(build.debug_options)


def graph_collectives_options() -> dict:
    """Options that record a step's NCCL all-reduces into its command buffers: COLLECTIVES added
    to this XLA's default command-buffer types, graphs of any size, and XLA's own collective
    kernels off where this XLA has them (a thunk kind the command-buffer conversion does not take)."""
    text = _default_debug_options()
    types = set(re.findall(r"^xla_gpu_enable_command_buffer: (\w+)$", text, re.M)) | {"COLLECTIVES"}
    options = {"xla_gpu_enable_command_buffer": ",".join(sorted(types)), "xla_gpu_graph_min_graph_size": 1}
    kernels = re.search(r"^xla_gpu_experimental_use_collective_kernels: (\w+)$", text, re.M)
    if kernels:  # a list of collective kinds (empty clears it) or, in some versions, a switch
        options["xla_gpu_experimental_use_collective_kernels"] = \
            False if kernels.group(1) in ("true", "false") else ""
    return options


def graph_collectives_from_rows() -> int | None:
    """`JSPEC_TP_GRAPH_COLLECTIVES_FROM_ROWS` as an int, or None when unset."""
    value = os.environ.get(GRAPH_COLLECTIVES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"{GRAPH_COLLECTIVES_ENV} must be a row count, got {value!r}")
    return int(value)


def prompt_matmuls() -> str:
    """How prompt-chunk steps' matmuls compile on a GPU (`JSPEC_PROMPT_MATMULS`, one of
    PROMPT_MATMULS; default autotune); another value is a ConfigError naming the variable."""
    value = os.environ.get(PROMPT_MATMULS_ENV, "").strip() or PROMPT_MATMULS[0]
    if value not in PROMPT_MATMULS:
        raise ConfigError(f"{PROMPT_MATMULS_ENV}: give one of {list(PROMPT_MATMULS)}, got {value!r}")
    return value


def uncaptured_parts() -> frozenset[str] | None:
    """The split-step parts `JSPEC_GRAMMAR_UNCAPTURED_PARTS` names (empty for `none`), or None when
    unset; a name outside SPLIT_PARTS is a ConfigError naming the variable."""
    return _part_names(UNCAPTURED_PARTS_ENV)


def _part_names(env: str) -> frozenset[str] | None:
    """The split-step parts the environment variable `env` names, comma separated (empty for
    `none`), or None when unset; a name outside SPLIT_PARTS is a ConfigError naming `env`."""
    value = os.environ.get(env, "").strip()
    if not value:
        return None
    names = frozenset(n.strip() for n in value.split(",") if n.strip()) - {"none"}
    unknown = sorted(names - set(SPLIT_PARTS))
    if unknown:
        raise ConfigError(f"{env}: unknown part(s) {unknown}; give any of {list(SPLIT_PARTS)} "
                          f"or none, comma separated, got {value!r}")
    return names


def grammar_update_mode() -> str | None:
    """`JSPEC_GRAMMAR_UPDATE_MODE` (an XLA command-buffer update mode's name), or None when unset."""
    value = os.environ.get(UPDATE_MODE_ENV, "").strip()
    if not value:
        return None
    if not re.fullmatch(r"[A-Z][A-Z_]*", value):
        raise ConfigError(f"{UPDATE_MODE_ENV} must name one of XLA's command-buffer update modes "
                          f"(e.g. SKIP_TEMP), got {value!r}")
    return value


def split_parts(bucket: Bucket) -> tuple[str, ...]:
    """The parts of bucket's split step, in `split_step.lower`'s order (before the fused twin)."""
    return SPLIT_PARTS if bucket.grammar_pipeline else ("draft", "verify")  # no forward part of its own


def split_part_name(bucket: Bucket, part: int) -> str | None:
    """Which part of a split step `part` is in `split_step.lower`'s order; None for the fused twin."""
    names = split_parts(bucket)
    return names[part] if part < len(names) else None


def default_uncaptured_parts(bucket: Bucket) -> frozenset[str]:
    """The parts of a constrained speculative split step that compile without command buffers when
    JSPEC_GRAMMAR_UNCAPTURED_PARTS is unset: a non-pipelined step's verify part (launched with the
    device idle); none of a pipelined step's."""
    return frozenset() if bucket.grammar_pipeline else frozenset({"verify"})


def chosen_uncaptured_parts(bucket: Bucket) -> frozenset[str]:
    """The split-step parts that compile uncaptured: those JSPEC_GRAMMAR_UNCAPTURED_PARTS names, else
    `default_uncaptured_parts`."""
    chosen = uncaptured_parts()
    return default_uncaptured_parts(bucket) if chosen is None else chosen


def step_compiler_options(platform: str, bucket: Bucket, drafting, part: int = 0, tp: int = 1) -> dict:
    """The XLA options to compile bucket's step with on `platform` (a jax device's platform);
    part: which compiled part of a split step (`split_step.lower`'s order: 0 the first; then a
    pipelined step's forward, the part after the host's grammar walk, the fused twin; a one-part
    step is part 0); tp: devices the target is split over."""
    if platform != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    options = {}
    heuristic = bucket.mode is ForwardMode.DECODE or prompt_matmuls() == "cublas"
    if (heuristic and target_rows(bucket, drafting) >= CUBLAS_FROM_ROWS
            and "xla_gpu_enable_triton_gemm" not in flags):
        options["xla_gpu_enable_triton_gemm"] = False
        if "xla_gpu_autotune_level" not in flags:
            options["xla_gpu_autotune_level"] = 0
    if (bucket.grammar_split and drafting is not None and bucket.speculate
            and "xla_gpu_enable_command_buffer" not in flags):
        if split_part_name(bucket, part) in chosen_uncaptured_parts(bucket):
            options["xla_gpu_enable_command_buffer"] = ""  # a repeated option: empty clears every type
        elif (mode := grammar_update_mode()) and split_part_name(bucket, part) is not None \
                and "xla_gpu_command_buffer_update_mode" not in flags:
            options["xla_gpu_command_buffer_update_mode"] = mode
    from_rows = graph_collectives_from_rows()
    if (tp > 1 and from_rows is not None and bucket.mode is ForwardMode.DECODE
            and target_rows(bucket, drafting) >= from_rows and "xla_gpu_enable_command_buffer" not in options
            and "xla_gpu_enable_command_buffer" not in flags):
        options.update(graph_collectives_options())
    return options


def uses_static_carry(bucket: Bucket, drafting) -> bool:
    """Whether a constrained speculative split step hands its carry between its parts in static
    buffers (`jspec.runtime.static_carry`), so that its captured parts' graphs are not re-recorded
    before every launch: by default whenever one of its parts keeps its graph
    (`chosen_uncaptured_parts`). `JSPEC_GRAMMAR_STATIC_CARRY=0` or `1` decides it for every bucket."""
    if drafting is None or not bucket.grammar_split or not bucket.speculate:
        return False
    chosen = _switch(STATIC_CARRY_ENV)
    return not set(split_parts(bucket)) <= chosen_uncaptured_parts(bucket) if chosen is None else chosen


def copied_parts(platform: str, bucket: Bucket) -> frozenset[str]:
    """The parts of a constrained split step (`split_parts` names) that run as two loaded copies
    taken in turn (`jspec.runtime.part_copies`), on a GPU only (where graphs are captured and
    re-recorded): by default a pipelined step's forward where it is captured (not named
    uncaptured). `JSPEC_GRAMMAR_PART_COPIES` names them for every split bucket on a GPU;
    else `JSPEC_GRAMMAR_FORWARD_COPIES=0` or `1` decides the forward's for every pipelined one."""
    if platform != "gpu" or not bucket.grammar_split:
        return frozenset()
    named = _part_names(PART_COPIES_ENV)
    if named is not None:
        return named & frozenset(split_parts(bucket))
    if not bucket.grammar_pipeline:
        return frozenset()
    chosen = _switch(FORWARD_COPIES_ENV)
    on = "forward" not in chosen_uncaptured_parts(bucket) if chosen is None else chosen
    return frozenset({"forward"}) if on else frozenset()


def _switch(name: str) -> bool | None:
    """The on / off environment variable `name`: True for 1, False for 0, None when unset;
    anything else is a ConfigError naming it."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1" if value else None
