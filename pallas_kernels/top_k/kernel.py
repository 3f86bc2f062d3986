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

With `threshold`, a pass before the first round takes each block's maximum, and each row's k-th
largest of those is a bound every one of its k best reaches; a first-round program whose block's
maximum falls below it writes EMPTY after one reduction instead of k rounds of two. Most blocks of
a vocabulary row are such blocks. On by default (`threshold=False`: the rounds alone).

`rows` (optional, `[R]` bool) names the rows whose top k is wanted: the programs of the other rows
write no candidates but EMPTY and return, and those rows come back as zeros (ids 0). A sampler
asks for top logprobs only for the requests that return them, so a batch that wants none pays a
launch, not a pass over its logits.

Lowering: Triton (reductions over one program's registers; the same kernel runs in CPU interpret
mode). The measurements behind the block size and against XLA's top-k: NOTES.md.
"""

from __future__ import annotations

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


def _select_kernel(want_ref, tau_ref, key_ref, id_ref, key_out, id_out, *, k, kpad, block, width):
    r, c = pl.program_id(0), pl.program_id(1)  # (read outside the branches: interpret mode needs it)
    select = lambda: _select(r, c, tau_ref, key_ref, id_ref, key_out, id_out, k=k, kpad=kpad,  # noqa: E731
                             block=block, width=width)
    if want_ref is None:
        select()
        return
    want = want_ref[r] != 0
    pl.when(want)(select)
    pl.when(jnp.logical_not(want))(lambda: _write_empty(r, c, key_out, id_out, kpad))


def _write_empty(r, c, key_out, id_out, kpad):
    key_out[r, c, :] = jnp.full((kpad,), LOWEST, jnp.int32)
    id_out[r, c, :] = jnp.full((kpad,), EMPTY, jnp.int32)


def _load(r, c, key_ref, id_ref, *, block, width):
    """A block's keys and ids; entries past the row's end are dead (id EMPTY)."""
    cols = pl.ds(c * block, block)
    pos = c * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    inside = pos < width
    if id_ref is None:  # first round: x itself; an entry's id is its column
        key = total_order_key(plt.load(key_ref.at[r, cols], mask=inside, other=0.0).astype(jnp.float32))
        return key, jnp.where(inside, pos, EMPTY)
    return (plt.load(key_ref.at[r, cols], mask=inside, other=LOWEST),
            plt.load(id_ref.at[r, cols], mask=inside, other=EMPTY))


def _select(r, c, tau_ref, key_ref, id_ref, key_out, id_out, *, k, kpad, block, width):
    key, ids = _load(r, c, key_ref, id_ref, block=block, width=width)
    live = ids != EMPTY
    if tau_ref is None:
        _best(r, c, key, ids, live, key_out, id_out, k=k, kpad=kpad)
        return
    # Only a block holding an entry >= the row's threshold can hold one of its k best.
    keep = jnp.max(jnp.where(live, key, LOWEST)) >= tau_ref[r]
    pl.when(keep)(lambda: _best(r, c, key, ids, live, key_out, id_out, k=k, kpad=kpad))
    pl.when(jnp.logical_not(keep))(lambda: _write_empty(r, c, key_out, id_out, kpad))


def _best(r, c, key, ids, live, key_out, id_out, *, k, kpad):
    """The k best live entries, one at a time: the max, then the lowest id holding it."""
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


def _block_max_kernel(want_ref, x_ref, out_ref, *, block, width):
    r, c = pl.program_id(0), pl.program_id(1)

    def block_max():
        key, ids = _load(r, c, x_ref, None, block=block, width=width)
        out_ref[r, c] = jnp.max(jnp.where(ids != EMPTY, key, LOWEST))

    if want_ref is None:
        block_max()
        return
    want = want_ref[r] != 0
    pl.when(want)(block_max)

    @pl.when(jnp.logical_not(want))
    def _():  # a row left out: its blocks are not read (the first round skips them anyway)
        out_ref[r, c] = LOWEST


def _threshold(x, k: int, block: int, want, *, interpret: bool, num_warps: int):
    """Each row's k-th largest block maximum (as a key), `[R]`: the k blocks holding those maxima
    hold k entries at least that large, so the row's k best are all >= it, and a block whose
    maximum is below it holds none of them. Rows `want` `[R]` int32 leaves out are not read."""
    rows, width = x.shape
    chunks = -(-width // block)
    args = (x,) if want is None else (want, x)

    def kernel(*refs):
        want_ref = refs[0] if want is not None else None
        _block_max_kernel(want_ref, *refs[len(args) - 1:], block=block, width=width)

    maxima = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, chunks), jnp.int32),
        grid=(rows, chunks),
        in_specs=[ANY] * len(args),
        out_specs=ANY,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="top_k_block_max",
    )(*args)
    return jax.lax.top_k(maxima, k)[0][:, k - 1]


def _round(keys, ids, k: int, block: int, want, tau=None, *, interpret: bool, num_warps: int):
    """One round: the k best of every `block` entries of each row, as `[R, C * kpad]` candidates
    (of the rows `want` `[R]` int32 names, when given; of the blocks reaching `tau` `[R]`, when
    given)."""
    rows, width = keys.shape
    kpad = _pow2(k)
    chunks = -(-width // block)
    args = tuple(a for a in (want, tau, keys, ids) if a is not None)

    def kernel(*refs):
        refs = list(refs)
        want_ref = refs.pop(0) if want is not None else None
        tau_ref = refs.pop(0) if tau is not None else None
        key_ref = refs.pop(0)
        id_ref = refs.pop(0) if ids is not None else None
        _select_kernel(want_ref, tau_ref, key_ref, id_ref, *refs, k=k, kpad=kpad, block=block, width=width)

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


def top_k(x, k: int, rows=None, *, block: int = 1024, interpret: bool = False, num_warps: int = 4,
          threshold: bool = True):
    """`lax.top_k(x, k)` of x `[R, N]` (k <= N): values `[R, k]` in x's dtype, ids `[R, k]` int32;
    with `rows` (`[R]` bool) zeros for the rows it leaves out. threshold: a first pass takes each
    block's maximum (`_threshold`), and the first round selects only in the blocks that can hold
    one of the k best: two more launches and a second read of x, against k reductions saved in
    almost every block (faster at every row count measured, NOTES.md)."""
    n_rows, width = x.shape
    if not 0 < k <= width:
        raise ValueError(f"top_k: k={k} must be in [1, {width}] (the row length of x {x.shape})")
    if rows is not None and rows.shape != (n_rows,):
        raise ValueError(f"top_k: rows {rows.shape} must be [{n_rows}] (one flag per row of x {x.shape})")
    want = None if rows is None else rows.astype(jnp.int32)
    # At least two candidate slots per kept one, so every round shrinks the rows (no endless loop).
    block = max(_pow2(min(block, width)), 2 * _pow2(k))
    tau = None
    if threshold and -(-width // block) > k:  # (with k blocks or fewer, every block may hold some)
        tau = _threshold(x, k, block, want, interpret=interpret, num_warps=num_warps)
    keys, ids = _round(x, None, k, block, want, tau, interpret=interpret, num_warps=num_warps)
    while keys.shape[1] > _pow2(k):  # more than one block's candidates left: another round
        keys, ids = _round(keys, ids, k, min(block, _pow2(keys.shape[1])), want, interpret=interpret,
                           num_warps=num_warps)
    ids = ids[:, :k]
    if rows is None:
        return jnp.take_along_axis(x, ids, axis=-1), ids
    ids = jnp.where(rows[:, None], ids, 0)
    return jnp.where(rows[:, None], jnp.take_along_axis(x, ids, axis=-1), jnp.zeros((), x.dtype)), ids
