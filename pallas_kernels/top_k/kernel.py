"""Top-k over long rows (a vocabulary's logprobs) in two or more rounds of one selection kernel.

XLA's GPU top-k gives one thread block to each row (so a 151,936-token row keeps one SM busy) and
sorts every row outright when k > 16. Here a round splits each row into blocks of `block` entries,
one program per (row, block): the program holds its block in registers and takes its k best, one
at a time, as a max over the entries still live, then the lowest id holding that max (lax.top_k's
tie order), then retires that id. It writes them as `kpad` candidates (key, id); slots past k and
blocks with fewer than k entries carry the id `EMPTY`, which never wins a later round. The next
round runs the same kernel over the candidates, with their ids, until one block holds a row's.

Same ids and tie order as `lax.top_k`: a candidate's id travels with it, and every round breaks a
tie by the lowest id, so the k best of a row reach the last round whatever block they came from.
Entries compare as lax.top_k compares them, in the floats' total order (-NaN < -inf < ... < -0.0 <
0.0 < ... < inf < NaN), through an int32 key with that order (`total_order_key`). Values are read
back from x by id, so they are x's own.

Lowering: Triton (reductions over one program's registers; the same kernel runs in CPU interpret
mode). The measurements behind the block size and against XLA's top-k: NOTES.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

EMPTY = jnp.iinfo(jnp.int32).max  # the id of "no candidate": never live
LOWEST = jnp.iinfo(jnp.int32).min
ANY = pl.BlockSpec(memory_space=pl.ANY)


def total_order_key(x):
    """An int32 per float32 entry that orders as the floats' total order: a non-negative float's
    bits already do; a negative one's, with every bit but the sign flipped, order the other way."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _select_kernel(key_ref, id_ref, key_out, id_out, *, k, kpad, block, width):
    r, c = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(c * block, block)
    pos = c * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    inside = pos < width
    if id_ref is None:  # first round: x itself; an entry's id is its column
        key = total_order_key(plt.load(key_ref.at[r, cols], mask=inside, other=0.0).astype(jnp.float32))
        ids = jnp.where(inside, pos, EMPTY)
    else:
        key = plt.load(key_ref.at[r, cols], mask=inside, other=LOWEST)
        ids = plt.load(id_ref.at[r, cols], mask=inside, other=EMPTY)
    live = ids != EMPTY
    slot = jax.lax.broadcasted_iota(jnp.int32, (kpad,), 0)
    best_keys = jnp.full((kpad,), LOWEST, jnp.int32)
    best_ids = jnp.full((kpad,), EMPTY, jnp.int32)
    for i in range(k):
        top = jnp.max(jnp.where(live, key, LOWEST))
        pick = jnp.min(jnp.where(live & (key == top), ids, EMPTY))
        live = live & (ids != pick)
        best_keys = jnp.where(slot == i, top, best_keys)
        best_ids = jnp.where(slot == i, pick, best_ids)
    key_out[r, c, :] = best_keys
    id_out[r, c, :] = best_ids


def _round(keys, ids, k: int, block: int, *, interpret: bool, num_warps: int):
    """One round: the k best of every `block` entries of each row, as `[R, C * kpad]` candidates."""
    rows, width = keys.shape
    kpad = _pow2(k)
    chunks = -(-width // block)
    args = (keys,) if ids is None else (keys, ids)
    kernel = functools.partial(_select_kernel, k=k, kpad=kpad, block=block, width=width)
    if ids is None:
        kernel = functools.partial(lambda f, key_ref, *rest: f(key_ref, None, *rest), kernel)
    out_keys, out_ids = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, chunks, kpad), jnp.int32),
                   jax.ShapeDtypeStruct((rows, chunks, kpad), jnp.int32)),
        grid=(rows, chunks),
        in_specs=[ANY] * len(args),
        out_specs=[ANY, ANY],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="top_k_round",
    )(*args)
    return out_keys.reshape(rows, chunks * kpad), out_ids.reshape(rows, chunks * kpad)


def top_k(x, k: int, *, block: int = 1024, interpret: bool = False, num_warps: int = 4):
    """`lax.top_k(x, k)` of x `[R, N]` (k <= N): values `[R, k]` in x's dtype, ids `[R, k]` int32."""
    rows, width = x.shape
    if not 0 < k <= width:
        raise ValueError(f"top_k: k={k} must be in [1, {width}] (the row length of x {x.shape})")
    # At least two candidate slots per kept one, so every round shrinks the rows (no endless loop).
    block = max(_pow2(min(block, width)), 2 * _pow2(k))
    keys, ids = _round(x, None, k, block, interpret=interpret, num_warps=num_warps)
    while keys.shape[1] > _pow2(k):  # more than one block's candidates left: another round
        keys, ids = _round(keys, ids, k, min(block, _pow2(keys.shape[1])), interpret=interpret,
                           num_warps=num_warps)
    ids = ids[:, :k]
    return jnp.take_along_axis(x, ids, axis=-1), ids
