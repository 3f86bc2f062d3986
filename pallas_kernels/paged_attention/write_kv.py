"""KV write: scatter this step's K/V `[T, G, D]` into their page slots, in place.

One program per token copies its `[G, D]` rows to slot `page * L + row` of the flattened pages,
or does nothing for a padding token (negative slot). The page arrays are aliased to the outputs
(`input_output_aliases`), so under `jax.jit(..., donate_argnums=...)` the caches are updated in
place and only T x G x D elements move.

Kept separate from the attention kernel rather than fused into it: a split of one request may
read a page that another program of the same launch would be writing, and ordering those needs a
grid-wide barrier. The write moves T x G x D x 2 elements against the attention's S x G x D x 2
reads, so a separate launch costs a few microseconds. The public `write_kv` is this kernel, not
XLA's scatter (`reference.write_kv`): donated, on the same inputs, it is faster at every T measured,
by far the most at prefill sizes (bench/kernels/paged_attention.py; figures in NOTES.md).

Lowering: Triton, so that the same kernel runs in interpret mode on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as _pltriton

    _TritonParams = _pltriton.CompilerParams
except ImportError:  # pragma: no cover
    _TritonParams = None


def _kernel(slot_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref):
    del k_in_ref, v_in_ref  # aliased to the outputs: written through k_out_ref / v_out_ref
    slot = slot_ref[pl.program_id(0)]
    num_kv_heads = k_new_ref.shape[0]

    @pl.when(slot >= 0)
    def _():
        if num_kv_heads & (num_kv_heads - 1) == 0:  # power of two: one [G, D] tile
            k_out_ref[slot] = k_new_ref[...]
            v_out_ref[slot] = v_new_ref[...]
        else:  # Triton tiles need power-of-two sides: one [D] row per KV head
            for g in range(num_kv_heads):
                k_out_ref[slot, g] = k_new_ref[g]
                v_out_ref[slot, g] = v_new_ref[g]


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, *, interpret: bool = False):
    """Scatter new K/V `[T, G, D]` into pages `[P, L, G, D]` at flat slots `[T]` (`page * L + row`);
    negative slots are skipped. Same contract as `reference.write_kv`, plus `interpret`."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_tokens = k_new.shape[0]
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    params = {}
    if not interpret and _TritonParams is not None:
        params["compiler_params"] = _TritonParams(num_warps=1, num_stages=1)
    new_spec = pl.BlockSpec((None, num_kv_heads, head_dim), lambda t: (t, 0, 0))
    whole = pl.BlockSpec(flat, lambda t: (0, 0, 0))
    k_flat, v_flat = pl.pallas_call(
        _kernel,
        grid=(num_tokens,),
        in_specs=[pl.BlockSpec((num_tokens,), lambda t: (0,)), new_spec, new_spec, whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(flat, k_pages.dtype), jax.ShapeDtypeStruct(flat, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        name="paged_write_kv",
        **params,
    )(
        slot_mapping.astype(jnp.int32),
        k_new.astype(k_pages.dtype),
        v_new.astype(v_pages.dtype),
        k_pages.reshape(flat),
        v_pages.reshape(flat),
    )
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)
