"""The operations models call, each with its kernel, its jnp reference and its tensor-parallel map.

Models call these functions only. Each picks its implementation through `dispatch` (the backend:
reference, pallas or interpret) and, in a layer split over `tp` devices, runs it per device under
`jax.shard_map` with the specs below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jspec.models.dispatch import PAGES, SSM, TOK2, TOK3, R, backend, kernel, per_device, pick
from jspec.sharding import TP
from pallas_kernels.gdn import reference as gdn_ref
from pallas_kernels.moe import reference as moe_ref
from pallas_kernels.paged_attention import reference as attn_ref
from pallas_kernels.rms_norm import reference as norm_ref
from pallas_kernels.top_k import reference as topk_ref


# ----------------------------------------------------------------------------- norms


def add_rms_norm(x, delta, weight, *, eps: float, zero_centred: bool, tp: int = 1):
    """(x + delta, its RMSNorm by weight) for rows `[T, E]` of the residual stream, which is whole
    on every device of a split target; delta None: (x, its RMSNorm)."""
    fn, kw = pick("rms_norm", "add_rms_norm", norm_ref.add_rms_norm)
    args = (x, weight) if delta is None else (x, delta, weight)

    def local(x, *rest):
        *d, w = rest
        return fn(x, d[0] if d else None, w, eps=eps, zero_centred=zero_centred, **kw)

    return per_device(local, tp, (R,) * len(args), (R, R))(*args)


# ----------------------------------------------------------------------------- paged attention


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, *, tp: int = 1):
    fn, kw = pick("paged_attention", "write_kv", attn_ref.write_kv)
    run = per_device(lambda *a: fn(*a, **kw), tp, (PAGES, PAGES, TOK3, TOK3, R), (PAGES, PAGES))
    return run(k_pages, v_pages, k_new, v_new, slot_mapping)


def norm_rope_write(qkv, cos, sin, q_norm, k_norm, k_pages, v_pages, slot_mapping, *, num_heads: int, eps: float,
                    zero_centred: bool, gated: bool = False, tp: int = 1):
    """Attention's inputs from the fused projection `[T, H * Dq + 2G * D]` (shard-major over tp;
    Dq = 2D with `gated`: each q head [query | gate]): q `[T, H, D]` RMS-normed per head (q_norm /
    k_norm None: no norm) and rotated, k (normed, rotated) and v `[T, G, D]`, both also written into
    the pages. Returns (q, k, v, k_pages, v_pages). One kernel where the shapes allow (power-of-two
    head and rotary dims), else the reference's steps."""
    fn, kw = pick("paged_attention", "norm_rope_write", attn_ref.norm_rope_write)
    fits = kernel("paged_attention", "norm_rope_supported")
    if backend() != "reference" and (fits is None or not fits(k_pages.shape[-1], cos.shape[-1])):
        fn, kw = attn_ref.norm_rope_write, {}
    weights = () if q_norm is None else (q_norm, k_norm)

    def local(qkv, cos, sin, *rest):
        *w, k_pages, v_pages, slots = rest
        q_w, k_w = w if w else (None, None)
        return fn(qkv, cos, sin, q_w, k_w, k_pages, v_pages, slots, num_heads=num_heads // tp, eps=eps,
                  zero_centred=zero_centred, gated=gated, **kw)

    in_specs = (TOK2, R, R) + (R,) * len(weights) + (PAGES, PAGES, R)
    run = per_device(local, tp, in_specs, (TOK3, TOK3, TOK3, PAGES, PAGES))
    return run(qkv, cos, sin, *weights, k_pages, v_pages, slot_mapping)


def paged_attention(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, *, sm_scale, mask_mode="causal",
                    custom_mask=None, tp: int = 1):
    fn, kw = pick("paged_attention", "paged_attention", attn_ref.paged_attention)

    def attend(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, *mask):
        return fn(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, sm_scale=sm_scale, mask_mode=mask_mode,
                  custom_mask=mask[0] if mask else None, **kw)

    mask = () if custom_mask is None else (custom_mask,)
    run = per_device(attend, tp, (TOK3, PAGES, PAGES, R, R, R) + (R,) * len(mask), TOK3)
    return run(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, *mask)


# Prompt-chunk buckets from this many tokens take cuDNN for their requests' own tokens
# (`extend_attention`); at 2048 the kernel alone was as fast or faster (NOTES.md of paged_attention).
PREFILL_CUDNN_MIN_TOKENS = 4096


def extend_attention(q, k, v, k_pages, v_pages, page_table, seq_lens, cu_q_lens, *, sm_scale, tp: int = 1):
    """Causal attention of a prompt chunk: q `[T, H, D]`, its own k / v `[T, G, D]` (already written
    into the pages too). On a GPU where cuDNN's part runs and in buckets of
    `PREFILL_CUDNN_MIN_TOKENS` or more, the chunk's own tokens go through cuDNN and the cached
    prefix through the kernel (`paged_attention/prefill.py`); in interpret mode the same path runs
    with the jnp stand-in for cuDNN; otherwise `paged_attention`."""
    b = backend()
    own = None
    if b == "interpret":
        own = "reference"
    elif b == "pallas" and q.shape[0] >= PREFILL_CUDNN_MIN_TOKENS:
        fits = kernel("paged_attention", "cudnn_available")
        own = "cudnn" if fits is not None and fits(q.dtype) else None
    fn, kw = pick("paged_attention", "prefill_attention", None)
    if own is None or fn is None:
        return paged_attention(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, sm_scale=sm_scale, tp=tp)
    run = per_device(lambda *a: fn(*a, sm_scale=sm_scale, own=own, **kw), tp,
                     (TOK3, TOK3, TOK3, PAGES, PAGES, R, R, R), TOK3)
    return run(q, k, v, k_pages, v_pages, page_table, seq_lens, cu_q_lens)


def paged_decode(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale, tp: int = 1):
    fn, kw = pick("paged_attention", "paged_decode", attn_ref.paged_decode)
    run = per_device(lambda *a: fn(*a, sm_scale=sm_scale, **kw), tp, (TOK3, PAGES, PAGES, R, R), TOK3)
    return run(q, k_pages, v_pages, page_table, seq_lens)


# ----------------------------------------------------------------------------- gated deltanet


# Channels of the conv `[T, C]` / weight `[C, K]` / pool `[S, C, K-1]`, heads of q, k, v `[T, H, d]`,
# gates `[T, Hv]` and states `[S, Hv, dk, dv]`.
_CONV_IN = (TOK2, P(TP, None), TOK3)
_QKVGB = (TOK3, TOK3, TOK3, TOK2, TOK2)


def causal_conv1d(x, weight, conv_pool, cu_seqlens, slots, has_initial, *, tp: int = 1):
    fn, kw = pick("gdn", "causal_conv1d", gdn_ref.causal_conv1d)
    run = per_device(lambda *a: fn(*a, **kw), tp, _CONV_IN + (R, R, R), (TOK2, TOK3))
    return run(x, weight, conv_pool, cu_seqlens, slots, has_initial)


def gated_delta_rule(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial, *, decode: bool, tp: int = 1,
                     save_rows=None):
    """decode=True promises one token per request (T == B): the recurrent kernel; else chunked.
    save_rows `[T]` (chunked only; -1 = none): the state after token t also goes to that pool row,
    taken at the ends of each request's 64-token chunks (`reference.gated_delta_rule`)."""
    name = "gated_delta_rule_decode" if decode else "gated_delta_rule"
    fn, kw = pick("gdn", name, gdn_ref.gated_delta_rule)
    if save_rows is None:
        run = per_device(lambda *a: fn(*a, **kw), tp, _QKVGB + (SSM, R, R, R), (TOK3, SSM))
        return run(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial)
    assert not decode, "snapshot rows are taken by the chunked prefill only"
    run = per_device(lambda *a: fn(*a[:-1], save_rows=a[-1], **kw), tp, _QKVGB + (SSM, R, R, R, R), (TOK3, SSM))
    return run(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial, save_rows)


def save_conv_windows(conv_pool, x, tokens, rows, *, tp: int = 1):
    """Conv windows of snapshots inside a prompt chunk (`reference.save_conv_windows`): conv_pool
    `[S, C, K-1]` and the conv input x `[T, C]` split by channels like `causal_conv1d`'s."""
    run = per_device(gdn_ref.save_conv_windows, tp, (TOK3, TOK2, R, R), TOK3)
    return run(conv_pool, x, tokens, rows)


def causal_conv1d_verify(x, weight, conv_pool, slots, parents, *, tp: int = 1):
    fn, kw = pick("gdn", "causal_conv1d_verify", gdn_ref.causal_conv1d_verify)
    run = per_device(lambda *a: fn(*a, **kw), tp, _CONV_IN + (R, R), (TOK2, P(None, None, TP, None)))
    return run(x, weight, conv_pool, slots, parents)


def gated_delta_rule_verify(q, k, v, g, beta, state_pool, slots, parents, *, tp: int = 1):
    fn, kw = pick("gdn", "gated_delta_rule_verify", gdn_ref.gated_delta_rule_verify)
    run = per_device(lambda *a: fn(*a, **kw), tp, _QKVGB + (SSM, R, R), TOK3)
    return run(q, k, v, g, beta, state_pool, slots, parents)


def gdn_commit(state_pool, conv_pool, conv_scratch, replay, slots, path, accepted, track_node, track_dst, *,
               tp: int = 1):
    """replay: the verified tokens' (k, v, g, beta); path `[B, N]`: `gdn_ref.accepted_path`;
    track_node / track_dst `[B]`: a path node whose state also goes to a snapshot row (-1: none)."""
    fn, kw = pick("gdn", "commit", gdn_ref.commit)
    in_specs = (SSM, TOK3, P(None, None, TP, None), TOK3, TOK3, TOK2, TOK2, R, R, R, R, R)
    run = per_device(lambda *a: fn(*a, **kw), tp, in_specs, (SSM, TOK3))
    return run(state_pool, conv_pool, conv_scratch, *replay, slots, path, accepted, track_node, track_dst)


# ----------------------------------------------------------------------------- mixture of experts


def moe_gather(x, experts, weights, gate_up, down, *, tp: int = 1, expert_parallel: bool = False):
    """Routed experts of decode / verify batches: the expert-tiled gather kernels read each routed
    expert about once per tile of up to 16 of its (token, k) pairs.
    x [T, E], experts / weights [T, K], gate_up [X, E, 2I], down [X, I, E] -> [T, E]. Split tp ways,
    each device runs its slice of every expert's intermediate dimension (its gate_up columns are
    [gate | up] of that slice, the shard-major layout) and the partial outputs are summed. With
    expert_parallel each device holds X / tp whole experts and runs the pairs routed to them (the
    others weigh 0 on an expert it holds), and the partial outputs are summed the same way."""
    fn, kw = pick("moe", "moe_gather", moe_ref.moe_gather)
    if tp == 1:
        return fn(x, experts, weights, gate_up, down, **kw)

    def partial(x, experts, weights, gate_up, down):
        if expert_parallel:
            local = experts - jax.lax.axis_index(TP) * gate_up.shape[0]
            mine = (local >= 0) & (local < gate_up.shape[0])
            experts, weights = jnp.where(mine, local, 0), jnp.where(mine, weights, jnp.zeros_like(weights))
        return jax.lax.psum(fn(x, experts, weights, gate_up, down, **kw), TP)

    w_specs = (P(TP, None, None),) * 2 if expert_parallel else (P(None, None, TP), TOK3)
    run = per_device(partial, tp, (R, R, R) + w_specs, R)
    return run(x, experts, weights, gate_up, down)


# ----------------------------------------------------------------------------- vocabulary


# Candidates cross devices through psums of small buffers, not all-gathers: XLA runs small
# all-reduces as its own fused kernel but all-gathers through NCCL, which cost a split decode
# step far more (measured in bench/README.md, "tensor parallelism").


def _vocab_split(x, tp: int, fill=-jnp.inf):
    """x `[B, V]` padded with fill to a multiple of tp (the padded columns were dropped from the
    logits; -inf never outranks a real entry, and no id reads or writes a padded column)."""
    v = x.shape[-1]
    return x if v % tp == 0 else jnp.pad(x, ((0, 0), (0, -v % tp)), constant_values=fill)


def _local_ids(ids, size: int):
    """Inside a mapped function: (ids in this device's slice of `size` rows / columns, clipped to
    0 outside it, and where they are inside)."""
    lid = ids - jax.lax.axis_index(TP) * size
    mine = (lid >= 0) & (lid < size)
    return jnp.where(mine, lid, 0), mine


def _all_rows(x):
    """Inside a mapped function: each device's `[B, m]` side by side, `[B, tp * m]`, device-major
    (a psum of zero-padded buffers, each device's slot selected by its index: exact, adding
    zeros; one small all-reduce, which `bench/tp_collectives.py` shows the GPU program keeps)."""
    n = jax.lax.psum(1, TP)
    mine = jax.lax.broadcasted_iota(jnp.int32, (1, n, 1), 1) == jax.lax.axis_index(TP)
    buf = jnp.where(mine, x[:, None, :], jnp.zeros((), x.dtype))
    return jax.lax.psum(buf, TP).reshape(x.shape[0], -1)


def vocab_argmax(x, *, tp: int = 1):
    """`jnp.argmax` over the vocabulary of x `[B, V]` (the lowest id among equal maxima). On a
    vocabulary split tp ways: each device's maximum and its id, then the global maximum and the
    lowest id holding it, two all-reduces of `[B]`."""
    if tp == 1:
        return jnp.argmax(x, axis=-1)

    def local(x):
        m = jnp.max(x, axis=-1)
        i = jnp.argmax(x, axis=-1).astype(jnp.int32) + jax.lax.axis_index(TP) * x.shape[-1]
        top = jax.lax.pmax(m, TP)
        return jax.lax.pmin(jnp.where(m == top, i, jnp.iinfo(jnp.int32).max), TP)

    return per_device(local, tp, (TOK2,), R)(_vocab_split(x, tp))


def top_k(x, k: int, rows=None):
    """`lax.top_k(x, k)` over the last axis of x `[R, N]`; on GPU the Pallas kernel: XLA's gives each
    row one thread block and sorts whole rows when k > 16 (bench/README.md, "top-k"). `rows` (`[R]`
    bool): only those rows are wanted; the others come back as zeros, and the kernel skips them."""
    fn, kw = pick("top_k", "top_k", topk_ref.top_k)
    return fn(x, k=k, rows=rows, **kw)


def vocab_top_k(x, k: int, *, tp: int = 1, rows=None):
    """`lax.top_k` over the vocabulary of x `[B, V]` (through `top_k`; `rows` as there). On a
    vocabulary split tp ways, each device takes the top k of its slice and only the tp x k
    candidates cross devices (XLA's own top_k over a split axis gathers whole rows first). Same
    values, ids and tie order (lower id first)."""
    v = x.shape[-1]
    if tp == 1 or k > v // tp:
        return top_k(x, k, rows)

    def local(x, *rows):
        vals, ids = top_k(x, k, *rows)
        return _all_rows(vals), _all_rows(ids + jax.lax.axis_index(TP) * x.shape[-1])

    extra = () if rows is None else (rows,)  # replicated: every device skips the same rows
    vals, ids = per_device(local, tp, (TOK2,) + (R,) * len(extra), (R, R))(_vocab_split(x, tp), *extra)
    # vals, ids: [B, tp * k], device-major
    best, pos = jax.lax.top_k(vals, k)
    ids = jnp.take_along_axis(ids, pos, axis=-1)
    if rows is None:
        return best, ids
    return jnp.where(rows[:, None], best, jnp.zeros((), x.dtype)), jnp.where(rows[:, None], ids, 0)


def vocab_take(x, ids, *, tp: int = 1):
    """`take_along_axis(x, ids, axis=-1)`: x `[..., V]`, ids `[..., K]` (the same leading axes) ->
    `[..., K]` (e.g. the sampled token's logprob, a draft token's probability). On a vocabulary
    split tp ways the device holding each id reads it and one all-reduce of `[..., K]` shares it
    (XLA's own partitioning of this gather collected whole rows at B = 1)."""
    if tp == 1:
        return jnp.take_along_axis(x, ids, axis=-1)

    def local(x, ids):
        lid, mine = _local_ids(ids, x.shape[-1])
        got = jnp.take_along_axis(x, lid, axis=-1)
        return jax.lax.psum(jnp.where(mine, got, jnp.zeros((), x.dtype)), TP)

    x2 = _vocab_split(x.reshape(-1, x.shape[-1]), tp, 0)
    out = per_device(local, tp, (TOK2, R), R)(x2, ids.reshape(x2.shape[0], -1))
    return out.reshape(x.shape[:-1] + ids.shape[-1:])


def vocab_put(x, ids, vals, *, tp: int = 1):
    """x `[..., V]` with `x[..., ids[..., k]] = vals[..., k]` (ids `[..., K]`, the same leading axes;
    a repeated id must carry one value). On a vocabulary split tp ways each device writes the ids in
    its slice: no collective."""
    return _vocab_scatter(x, ids, vals, tp, add=False)


def vocab_add(x, ids, vals, *, tp: int = 1):
    """x `[..., V]` with vals[..., k] added at `x[..., ids[..., k]]` (ids `[..., K]`, the same leading
    axes; a negative id adds nothing). As `vocab_put`, no collective on a split vocabulary."""
    return _vocab_scatter(x, ids, vals, tp, add=True)


def _vocab_scatter(x, ids, vals, tp: int, *, add: bool):
    v = x.shape[-1]
    x2, ids2, vals2 = x.reshape(-1, v), ids.reshape(-1, ids.shape[-1]), vals.reshape(-1, ids.shape[-1])
    rows = jnp.arange(x2.shape[0])[:, None]

    def write(x, cols, vals):
        at = x.at[rows, cols]
        return at.add(vals, mode="drop") if add else at.set(vals, mode="drop")

    if tp == 1:
        return write(x2, jnp.where(ids2 >= 0, ids2, v), vals2).reshape(x.shape)  # negative: past the end, dropped

    def local(x, ids, vals):
        lid, mine = _local_ids(ids, x.shape[-1])
        return write(x, jnp.where(mine, lid, x.shape[-1]), vals)  # not here: dropped

    out = per_device(local, tp, (TOK2, R, R), TOK2)(_vocab_split(x2, tp, 0), ids2, vals2)
    return out[:, :v].reshape(x.shape)


def vocab_embed(table, ids, *, tp: int = 1):
    """Rows `ids` (`[T]`, any shape) of an embedding table `[V, E]` -> `[T, E]`. With the table's
    rows split tp ways (Megatron's vocabulary-parallel embedding) each device looks up the ids in
    its slice, zeros elsewhere, and one all-reduce of `[T, E]` sums them; XLA's own partitioning of
    this gather may instead collect the whole table at small T."""
    if tp == 1:
        return jnp.take(table, ids, axis=0)

    def local(table, ids):
        lid, mine = _local_ids(ids, table.shape[0])
        rows = jnp.take(table, lid, axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype)), TP)

    return per_device(local, tp, (P(TP, None), R), R)(table, ids)
