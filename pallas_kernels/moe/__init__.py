"""Mixture-of-experts kernels (Pallas) for jspec.

`moe_gather`: the routed experts of decode / verify batches, same arguments and result as
`reference.moe_gather`, plus `interpret=True` to run the kernels on the CPU. Kernels in
`gather_gemv.py`, their tile plans in `tiles.py`; shapes they do not tile (hidden or intermediate
size not a multiple of 16, mixed dtypes) take the reference. The measurements behind the kernels'
choices: NOTES.md.
"""

from __future__ import annotations

from pallas_kernels.moe import reference
from pallas_kernels.moe.gather_gemv import MMA_ROWS, Config, choose, moe_gather_pallas, supported


def moe_gather(x, experts, weights, gate_up, down, *, interpret: bool = False, block_m: int = MMA_ROWS,
               sort: bool | None = None, up_cfg: Config | None = None, down_cfg: Config | None = None):
    """out[t] = sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = experts[t, k]."""
    if not supported(x, gate_up, down) or not (x.dtype == gate_up.dtype == down.dtype):
        return reference.moe_gather(x, experts, weights, gate_up, down)
    return moe_gather_pallas(x, experts, weights, gate_up, down, block_m=block_m, sort=sort, up_cfg=up_cfg,
                             down_cfg=down_cfg, interpret=interpret)


__all__ = ["moe_gather", "Config", "choose"]
