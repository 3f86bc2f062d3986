"""Paged attention kernels (Pallas) for jspec.

Public functions, same signatures as `reference.py` plus `interpret`:
- `write_kv`: scatter new K/V into page slots (in place under donation);
- `norm_rope_write`: per-head q / k RMSNorm, rotary embedding and the KV write in one kernel;
- `paged_attention`: ragged extend ("causal"), tree verify ("tree"), DFlash block ("full");
- `paged_decode`: one query token per request;
- `prefill_attention`: causal prompt chunks, cuDNN over the requests' own tokens and the kernel
  over the cached prefix (`cudnn_available` says where cuDNN's part runs).

Files: `kernel.py` (the one attention kernel and its static launch shapes), `query_blocks.py`
(ragged tokens <-> query blocks), `combine.py` (KV-split merge), `attention.py` (the public
attention functions), `prefill.py` (the two-part prompt-chunk attention), `write_kv.py` (the KV
scatter kernel), `norm_rope_write.py` (the fused norm, rotary and KV write), `reference.py` (the
pure-jnp oracle).
The measurements behind the kernels' choices: NOTES.md.
"""

from __future__ import annotations

from pallas_kernels.paged_attention.attention import paged_attention, paged_decode
from pallas_kernels.paged_attention.norm_rope_write import norm_rope_write
from pallas_kernels.paged_attention.norm_rope_write import supported as norm_rope_supported
from pallas_kernels.paged_attention.prefill import cudnn_available, prefill_attention
from pallas_kernels.paged_attention.write_kv import write_kv

__all__ = ["write_kv", "norm_rope_write", "norm_rope_supported", "paged_attention", "paged_decode",
           "prefill_attention", "cudnn_available"]
