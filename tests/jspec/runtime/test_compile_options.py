"""Per-step XLA options (`jspec.runtime.compile_options`): Triton GEMM fusions and XLA's autotuning
off for GPU decode steps whose target sees many token rows (cuBLAS's heuristic picks each
algorithm), XLA's default everywhere else."""

from __future__ import annotations

import pytest

from jspec.errors import ConfigError
from jspec.models.batch import ForwardMode
from jspec.runtime.compile_options import CUBLAS_FROM_ROWS, PROMPT_MATMULS_ENV, step_compiler_options, target_rows
from jspec.runtime.step_inputs import Bucket

OFF = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


class Chain:
    """A drafter verifying a chain of `steps` drafts plus the root (as EAGLE 3/1/4 does)."""

    def __init__(self, steps: int):
        self.steps = steps

    def grammar_nodes(self, draft_steps: int):
        s = draft_steps or self.steps
        return s + 1, s


def decode(b, **kw):
    return Bucket(ForwardMode.DECODE, b, b, b, **kw)


def test_rows_count_every_verified_token():
    assert target_rows(decode(8), None) == 8
    assert target_rows(decode(8), Chain(3)) == 32
    assert target_rows(decode(8, draft_steps=1), Chain(3)) == 16
    assert target_rows(decode(8, speculate=False), Chain(3)) == 8  # the plain step of a speculative engine
    assert target_rows(Bucket(ForwardMode.EXTEND, 1024, 64, 80), Chain(3)) == 1024


def test_triton_gemm_is_off_only_for_wide_gpu_decode_steps(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    wide, narrow = CUBLAS_FROM_ROWS, CUBLAS_FROM_ROWS - 1
    assert step_compiler_options("gpu", decode(wide), None) == OFF
    assert step_compiler_options("gpu", decode(narrow), None) == {}
    assert step_compiler_options("gpu", decode(8), Chain(3)) == OFF  # 32 verified rows
    assert step_compiler_options("gpu", decode(4), Chain(3)) == {}  # 16
    assert step_compiler_options("gpu", Bucket(ForwardMode.EXTEND, 8192, 64, 600), None) == {}
    assert step_compiler_options("cpu", decode(128), None) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")  # the user's choice stands
    assert step_compiler_options("gpu", decode(128), None) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")  # and so does an autotuning level
    assert step_compiler_options("gpu", decode(128), None) == {"xla_gpu_enable_triton_gemm": False}


def test_prompt_steps_take_cublas_heuristic_when_asked(monkeypatch):
    """JSPEC_PROMPT_MATMULS=cublas: prompt steps of at least CUBLAS_FROM_ROWS tokens compile as the
    wide decode steps do, shorter ones keep XLA's default, a user's XLA_FLAGS stand; an unknown
    value is a ConfigError naming the variable."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    prompt = Bucket(ForwardMode.EXTEND, 8192, 64, 600)
    monkeypatch.setenv(PROMPT_MATMULS_ENV, "autotune")
    assert step_compiler_options("gpu", prompt, None) == {}
    monkeypatch.setenv(PROMPT_MATMULS_ENV, "cublas")
    assert step_compiler_options("gpu", prompt, None) == OFF
    assert step_compiler_options("gpu", prompt, Chain(3)) == OFF
    assert step_compiler_options("gpu", Bucket(ForwardMode.EXTEND, CUBLAS_FROM_ROWS - 8, 16, 2), None) == {}
    assert step_compiler_options("cpu", prompt, None) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert step_compiler_options("gpu", prompt, None) == {}
    monkeypatch.setenv(PROMPT_MATMULS_ENV, "cuBLAS-ish")
    with pytest.raises(ConfigError, match=PROMPT_MATMULS_ENV + r".*'cuBLAS-ish'"):
        step_compiler_options("gpu", prompt, None)


def test_the_verify_part_of_a_constrained_speculative_step_runs_without_command_buffers(monkeypatch):
    """Without overlap it is launched with the device idle (after the host's grammar walk): kernels
    queued one by one start at once, a captured graph only once the whole of it is queued. A
    narrow pipelined step keeps every part's graph."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    split = decode(1, grammar_split=True, grammar_nodes=4, mask_words=8)
    no_graph = {"xla_gpu_enable_command_buffer": ""}
    assert step_compiler_options("gpu", split, Chain(3), part=1) == no_graph
    assert step_compiler_options("gpu", split, Chain(3), part=0) == {}  # the draft part: queued early
    assert step_compiler_options("gpu", split, Chain(3), part=2) == {}  # the fused twin
    piped = decode(1, grammar_split=True, grammar_pipeline=True, grammar_nodes=4, mask_words=8)
    assert [step_compiler_options("gpu", piped, Chain(3), part=i) for i in range(4)] == [{}] * 4
    assert step_compiler_options("gpu", decode(8, grammar_split=True), Chain(3), part=1) == {**OFF, **no_graph}
    assert step_compiler_options("gpu", decode(8, grammar_split=True), Chain(3), part=0) == OFF
    # The plain step of a speculative engine and a plain engine's split: their second part is the sampler.
    assert step_compiler_options("gpu", decode(1, grammar_split=True, speculate=False), Chain(3), part=1) == {}
    assert step_compiler_options("gpu", decode(1, grammar_split=True), None, part=1) == {}
    assert step_compiler_options("cpu", split, Chain(3), part=1) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")  # the user's choice stands
    assert step_compiler_options("gpu", split, Chain(3), part=1) == {}


def test_only_a_non_pipelined_constrained_step_runs_a_part_without_command_buffers(monkeypatch):
    """A pipelined constrained step keeps every part's graph at every width (its fused twin too); a
    non-pipelined step of any width compiles its verify part uncaptured."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JSPEC_GRAMMAR_UNCAPTURED_PARTS", raising=False)
    no_graph = {"xla_gpu_enable_command_buffer": ""}

    def uncaptured(b, pipeline=True, chain=Chain(3), n=4):
        bucket = decode(b, grammar_split=True, grammar_pipeline=pipeline, grammar_nodes=4, mask_words=8)
        return [no_graph.items() <= step_compiler_options("gpu", bucket, chain, part=i).items() for i in range(n)]

    for b in (1, 8, 64):
        assert uncaptured(b) == [False] * 4
        assert uncaptured(b, chain=Chain(1)) == [False] * 4
        assert uncaptured(b, pipeline=False, n=3) == [False, True, False]


def test_the_named_split_parts_run_without_command_buffers_when_asked(monkeypatch):
    """JSPEC_GRAMMAR_UNCAPTURED_PARTS names exactly the parts of constrained speculative split steps
    (pipelined or not) that compile uncaptured, in place of the default; the fused twin, plain
    steps and a user's XLA_FLAGS are untouched; a part it does not know is a ConfigError."""
    from jspec.runtime.compile_options import UNCAPTURED_PARTS_ENV

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    no_graph = {"xla_gpu_enable_command_buffer": ""}
    split = decode(1, grammar_split=True, grammar_nodes=4, mask_words=8)
    piped = decode(1, grammar_split=True, grammar_pipeline=True, grammar_nodes=4, mask_words=8)

    def parts(bucket, n):
        return [step_compiler_options("gpu", bucket, Chain(3), part=i) == no_graph for i in range(n)]

    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "forward")
    assert parts(piped, 4) == [False, True, False, False]  # draft, forward, verify, fused twin
    assert parts(split, 3) == [False, False, False]  # no forward part of its own; its verify keeps its graph
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, " draft , verify ")
    assert parts(piped, 4) == [True, False, True, False]
    assert parts(split, 3) == [True, True, False]
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "none")
    assert parts(split, 3) == [False, False, False]
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "draft,forward,verify")
    assert parts(piped, 4) == [True, True, True, False]
    assert step_compiler_options("gpu", decode(1, grammar_split=True, speculate=False), Chain(3), part=0) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    assert parts(piped, 4) == [False] * 4
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "forward,sample")
    with pytest.raises(ConfigError, match=UNCAPTURED_PARTS_ENV + r".*'sample'"):
        step_compiler_options("gpu", piped, Chain(3), part=1)


def test_the_captured_split_parts_take_the_asked_update_mode(monkeypatch):
    """JSPEC_GRAMMAR_UPDATE_MODE compiles the captured parts of constrained speculative split steps
    with that command-buffer update mode: not the parts that run uncaptured, not the fused twin,
    not plain steps, not where XLA_FLAGS names the mode; a malformed name is a ConfigError."""
    from jspec.runtime.compile_options import UPDATE_MODE_ENV

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JSPEC_GRAMMAR_UNCAPTURED_PARTS", raising=False)
    piped = decode(1, grammar_split=True, grammar_pipeline=True, grammar_nodes=4, mask_words=8)
    wide = decode(64, grammar_split=True, grammar_pipeline=True, grammar_nodes=4, mask_words=8)

    def modes(bucket, n=4):
        return [step_compiler_options("gpu", bucket, Chain(3), part=i).get("xla_gpu_command_buffer_update_mode")
                for i in range(n)]

    assert modes(piped) == [None] * 4  # unset: XLA's default
    monkeypatch.setenv(UPDATE_MODE_ENV, "SKIP_TEMP")
    assert modes(piped) == ["SKIP_TEMP"] * 3 + [None]  # draft, forward, verify; the fused twin keeps the default
    assert modes(wide) == ["SKIP_TEMP"] * 3 + [None]  # at every width
    monkeypatch.setenv("JSPEC_GRAMMAR_UNCAPTURED_PARTS", "forward")
    assert modes(wide) == ["SKIP_TEMP", None, "SKIP_TEMP", None]  # an uncaptured part takes no mode
    monkeypatch.delenv("JSPEC_GRAMMAR_UNCAPTURED_PARTS")
    assert step_compiler_options("gpu", decode(1), Chain(3), part=0) == {}
    assert step_compiler_options("cpu", piped, Chain(3), part=0) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE")  # the user's choice stands
    assert modes(piped) == [None] * 4
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv(UPDATE_MODE_ENV, "skip temp")
    with pytest.raises(ConfigError, match=UPDATE_MODE_ENV):
        step_compiler_options("gpu", piped, Chain(3), part=0)


def test_nccl_all_reduces_enter_the_graphs_of_wide_split_decode_steps_when_asked(monkeypatch):
    """`JSPEC_TP_GRAPH_COLLECTIVES_FROM_ROWS=N`: tensor-parallel decode steps of N target rows or
    more get COLLECTIVES added to this XLA's command-buffer types (off by default; never for one
    device, narrower steps, or a part that runs without graphs)."""
    import jax
    import jax.numpy as jnp

    from jspec.runtime.compile_options import GRAPH_COLLECTIVES_ENV, graph_collectives_options

    # JAX's backend reads XLA_FLAGS once, when it starts: start it under the session's flags (four
    # CPU devices), as later tests in this process need, before they are cleared here.
    jax.devices()
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv(GRAPH_COLLECTIVES_ENV, raising=False)
    assert step_compiler_options("gpu", decode(32), None, tp=2) == OFF
    monkeypatch.setenv(GRAPH_COLLECTIVES_ENV, "32")
    graphs = graph_collectives_options()
    types = graphs["xla_gpu_enable_command_buffer"].split(",")
    assert "COLLECTIVES" in types and "FUSION" in types and graphs["xla_gpu_graph_min_graph_size"] == 1
    assert step_compiler_options("gpu", decode(32), None, tp=2) == {**OFF, **graphs}
    assert step_compiler_options("gpu", decode(8), Chain(3), tp=2) == {**OFF, **graphs}  # 32 verified rows
    assert step_compiler_options("gpu", decode(16), None, tp=2) == {}
    assert step_compiler_options("gpu", decode(32), None, tp=1) == OFF
    split = decode(32, grammar_split=True, grammar_nodes=4, mask_words=8)
    assert step_compiler_options("gpu", split, Chain(3), part=1, tp=2) == {"xla_gpu_enable_command_buffer": "",
                                                                        **OFF}
    # Every option is one this XLA knows (a misspelt name or value fails the compile).
    jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile(graphs)
    monkeypatch.setenv(GRAPH_COLLECTIVES_ENV, "wide")
    with pytest.raises(ConfigError, match=GRAPH_COLLECTIVES_ENV):
        step_compiler_options("gpu", decode(32), None, tp=2)


def test_speculative_split_steps_with_a_captured_part_carry_in_static_buffers(monkeypatch):
    """Constrained speculative split steps of which a part keeps its graph hand their carry in static
    buffers, at every width by default; those whose parts all run uncaptured, plain steps and unsplit
    ones do not; JSPEC_GRAMMAR_STATIC_CARRY=0 / 1 decides for every split step, anything else is a
    ConfigError."""
    from jspec.runtime.compile_options import STATIC_CARRY_ENV, UNCAPTURED_PARTS_ENV, uses_static_carry

    monkeypatch.delenv(STATIC_CARRY_ENV, raising=False)
    monkeypatch.delenv(UNCAPTURED_PARTS_ENV, raising=False)
    wide = 64
    split = lambda b, **kw: decode(b, grammar_split=True, grammar_nodes=4, mask_words=8, **kw)  # noqa: E731
    assert uses_static_carry(split(1, grammar_pipeline=True), Chain(3))
    assert uses_static_carry(split(1), Chain(3))  # not pipelined: draft and verify parts
    assert uses_static_carry(split(wide, grammar_pipeline=True), Chain(3))  # every part keeps its graph
    assert uses_static_carry(split(wide), Chain(3))  # its draft part keeps its graph
    assert not uses_static_carry(split(1, speculate=False), Chain(3))  # a speculative engine's plain step
    assert not uses_static_carry(split(1), None) and not uses_static_carry(decode(1), Chain(3))
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "draft,forward,verify")
    assert not uses_static_carry(split(1, grammar_pipeline=True), Chain(3))
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "draft,verify")
    assert not uses_static_carry(split(1), Chain(3))  # no forward part of its own: nothing captured
    assert uses_static_carry(split(1, grammar_pipeline=True), Chain(3))
    monkeypatch.delenv(UNCAPTURED_PARTS_ENV)
    monkeypatch.setenv(STATIC_CARRY_ENV, "1")
    assert uses_static_carry(split(wide, grammar_pipeline=True), Chain(3))
    monkeypatch.setenv(STATIC_CARRY_ENV, "0")
    assert not uses_static_carry(split(1), Chain(3))
    monkeypatch.setenv(STATIC_CARRY_ENV, "yes")
    with pytest.raises(ConfigError, match=STATIC_CARRY_ENV):
        uses_static_carry(split(1), Chain(3))


def test_a_captured_pipelined_forward_runs_as_two_copies_on_a_gpu(monkeypatch):
    """A pipelined constrained step's forward part runs as two loaded copies (`part_copies`) where
    its graph can be re-recorded: on a GPU, unless it is named uncaptured; never on a CPU or for a
    split step without a forward part of its own; JSPEC_GRAMMAR_FORWARD_COPIES=0 / 1 decides for
    every pipelined step on a GPU, anything else is a ConfigError naming it."""
    from jspec.runtime.compile_options import (FORWARD_COPIES_ENV, PART_COPIES_ENV, UNCAPTURED_PARTS_ENV,
                                               copied_parts)

    for env in (FORWARD_COPIES_ENV, UNCAPTURED_PARTS_ENV, PART_COPIES_ENV):
        monkeypatch.delenv(env, raising=False)
    split = lambda b, **kw: decode(b, grammar_split=True, grammar_nodes=4, mask_words=8, **kw)  # noqa: E731
    piped = split(1, grammar_pipeline=True)
    forward = frozenset({"forward"})
    assert copied_parts("gpu", piped) == forward == copied_parts("gpu", split(64, grammar_pipeline=True))
    assert not copied_parts("cpu", piped)
    assert not copied_parts("gpu", split(1)) and not copied_parts("gpu", decode(1))
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "forward")
    assert not copied_parts("gpu", piped)
    monkeypatch.setenv(FORWARD_COPIES_ENV, "1")
    assert copied_parts("gpu", piped) == forward
    assert not copied_parts("cpu", piped) and not copied_parts("gpu", split(1))
    monkeypatch.setenv(UNCAPTURED_PARTS_ENV, "draft,verify")
    monkeypatch.setenv(FORWARD_COPIES_ENV, "0")
    assert not copied_parts("gpu", piped)
    monkeypatch.setenv(FORWARD_COPIES_ENV, "2")
    with pytest.raises(ConfigError, match=FORWARD_COPIES_ENV):
        copied_parts("gpu", piped)


def test_part_copies_names_the_copied_parts_of_every_split_step(monkeypatch):
    """JSPEC_GRAMMAR_PART_COPIES names the parts run as two copies, over the forward's own knob, for
    every split step on a GPU (those of its parts a step has: a non-pipelined one has no forward);
    `none` names none; an unknown part is a ConfigError naming the variable. `part_copies.for_split`
    loads a copy of each named part and hands it to the executable's attribute for it."""
    from jspec.runtime import part_copies
    from jspec.runtime.compile_options import FORWARD_COPIES_ENV, PART_COPIES_ENV, copied_parts

    split = lambda b, **kw: decode(b, grammar_split=True, grammar_nodes=4, mask_words=8, **kw)  # noqa: E731
    piped, plain_split = split(1, grammar_pipeline=True), split(1)
    monkeypatch.setenv(FORWARD_COPIES_ENV, "0")
    monkeypatch.setenv(PART_COPIES_ENV, "draft, forward,verify")
    assert copied_parts("gpu", piped) == {"draft", "forward", "verify"}
    assert copied_parts("gpu", plain_split) == {"draft", "verify"} and not copied_parts("cpu", piped)
    assert not copied_parts("gpu", decode(1))
    monkeypatch.setenv(PART_COPIES_ENV, "none")
    assert not copied_parts("gpu", piped)
    monkeypatch.setenv(PART_COPIES_ENV, "draft,sample")
    with pytest.raises(ConfigError, match=rf"{PART_COPIES_ENV}: unknown part\(s\) \['sample'\]"):
        copied_parts("gpu", piped)

    class Gpu:
        platform = "gpu"

    monkeypatch.setattr(part_copies, "load_copy", lambda part, devices: ("copy of", part))
    monkeypatch.setenv(PART_COPIES_ENV, "draft,verify")
    parts = ["first", "forward", "second", "fused"]
    assert part_copies.for_split(parts, piped, [Gpu()]) == {"first": ("copy of", "first"),
                                                           "second": ("copy of", "second")}
    assert part_copies.for_split(["first", "second", "fused"], plain_split, [Gpu()]) == \
        {"first": ("copy of", "first"), "second": ("copy of", "second")}
    monkeypatch.setenv(PART_COPIES_ENV, "forward")
    assert part_copies.for_split(parts, piped, [Gpu()]) == {"forward": ("copy of", "forward")}
