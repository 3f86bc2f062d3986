"""Per-step XLA options (`jspec.runtime.compile_options`): Triton GEMM fusions off for GPU decode
steps whose target sees many token rows, XLA's default everywhere else."""

from __future__ import annotations

from jspec.models.batch import ForwardMode
from jspec.runtime.compile_options import CUBLAS_FROM_ROWS, step_compiler_options, target_rows
from jspec.runtime.step_inputs import Bucket

OFF = {"xla_gpu_enable_triton_gemm": False}


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


def test_the_verify_part_of_a_constrained_speculative_step_runs_without_command_buffers(monkeypatch):
    """Without overlap it is launched with the device idle (after the host's grammar walk): kernels
    queued one by one start at once, a captured graph only once the whole of it is queued. A
    pipelined step's forward (part 1) is mostly queued early and keeps its graph."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    split = decode(1, grammar_split=True, grammar_nodes=4, mask_words=8)
    no_graph = {"xla_gpu_enable_command_buffer": ""}
    assert step_compiler_options("gpu", split, Chain(3), part=1) == no_graph
    assert step_compiler_options("gpu", split, Chain(3), part=0) == {}  # the draft part: queued early
    assert step_compiler_options("gpu", split, Chain(3), part=2) == {}  # the fused twin
    piped = decode(1, grammar_split=True, grammar_pipeline=True, grammar_nodes=4, mask_words=8)
    assert [step_compiler_options("gpu", piped, Chain(3), part=i) for i in range(4)] == [{}] * 4
    assert step_compiler_options("gpu", decode(8, grammar_split=True), Chain(3), part=1) == {**OFF, **no_graph}
    # The plain step of a speculative engine and a plain engine's split: their second part is the sampler.
    assert step_compiler_options("gpu", decode(1, grammar_split=True, speculate=False), Chain(3), part=1) == {}
    assert step_compiler_options("gpu", decode(1, grammar_split=True), None, part=1) == {}
    assert step_compiler_options("cpu", split, Chain(3), part=1) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")  # the user's choice stands
    assert step_compiler_options("gpu", split, Chain(3), part=1) == {}
