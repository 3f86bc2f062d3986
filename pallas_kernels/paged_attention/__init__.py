"""Paged attention kernels (Pallas) for jspec.

Public functions, same signatures as `reference.py` plus `interpret`:
- `write_kv`: scatter new K/V into page slots (in place under donation);
- `paged_attention`: ragged extend ("causal"), tree verify ("tree"), DFlash block ("full");
- `paged_decode`: one query token per request.

Files: `kernel.py` (the one attention kernel), `tuning.py` (static launch shapes),
`query_blocks.py` (ragged tokens <-> query blocks), `combine.py` (KV-split merge),
`attention.py` (the public attention functions), `write_kv.py` (the KV scatter kernel),
`reference.py` (the pure-jnp oracle).
"""

from __future__ import annotations

from pallas_kernels.paged_attention.attention import paged_attention, paged_decode
from pallas_kernels.paged_attention.write_kv import write_kv_pallas


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, *, interpret: bool = False):
    """Scatter new K/V `[T, G, D]` into pages `[P, L, G, D]`; negative slots are skipped.

    The Pallas scatter, not XLA's: donated, on an H200, 8 vs 12 us at T=32 and 16 vs 127 us at
    T=4096 (bench/results/kernels_paged_attention_h200.json, section write_kv).
    """
    return write_kv_pallas(k_pages, v_pages, k_new, v_new, slot_mapping, interpret=interpret)


__all__ = ["write_kv", "paged_attention", "paged_decode"]
