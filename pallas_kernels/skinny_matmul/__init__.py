"""A weight-streaming matmul for decode-sized batches (Pallas, Triton lowering): y = x @ w.T with
w in Hugging Face's `[out, in]` layout. Kernel in `kernel.py`, its oracle in `reference.py`."""

from __future__ import annotations

from pallas_kernels.skinny_matmul.kernel import Config, choose, skinny_matmul

__all__ = ["Config", "choose", "skinny_matmul"]
