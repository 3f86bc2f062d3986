"""Top-k over long rows (Pallas): `top_k(x, k)` with `lax.top_k`'s values, ids and tie order, in
rounds of a block-wise selection kernel (`kernel.py`); `reference.top_k` is the oracle."""

from pallas_kernels.top_k.kernel import top_k

__all__ = ["top_k"]
