"""XLA compiler options chosen per compiled step.

On a GPU, XLA lowers each matmul either to a cuBLAS call or to a Triton GEMM fusion, and picks the
Triton tiling by compiling and timing many candidate configurations (autotuning). For the skinny
matmuls of a decode step with few token rows the Triton fusions are faster; from about two dozen
rows cuBLAS is as fast or faster, and the Triton autotuning is most of such a step's compile time.
So a decode step whose target sees at least `CUBLAS_FROM_ROWS` token rows is compiled with Triton
GEMM fusions off (measurements: bench/README.md, "Start-up").

Prompt-chunk steps keep XLA's default. A user who names `xla_gpu_enable_triton_gemm` in XLA_FLAGS
keeps that choice for every step.
"""

from __future__ import annotations

import os

from jspec.models.batch import ForwardMode
from jspec.runtime.step_inputs import Bucket

CUBLAS_FROM_ROWS = 24


def target_rows(bucket: Bucket, drafting) -> int:
    """Token rows the target's matmuls see in one step of bucket: a speculative decode step
    verifies every request's drafted nodes, any other step has one row per token."""
    if bucket.mode is ForwardMode.EXTEND or drafting is None or not bucket.speculate:
        return bucket.num_tokens
    return bucket.batch_size * drafting.grammar_nodes(bucket.draft_steps)[0]


def step_compiler_options(platform: str, bucket: Bucket, drafting) -> dict:
    """The XLA options to compile bucket's step with on `platform` (a jax device's platform)."""
    if platform != "gpu" or bucket.mode is not ForwardMode.DECODE or target_rows(bucket, drafting) < CUBLAS_FROM_ROWS:
        return {}
    if "xla_gpu_enable_triton_gemm" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_gpu_enable_triton_gemm": False}
