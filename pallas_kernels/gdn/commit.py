"""Commit the accepted draft node: replay its path into the slot's state, copy its conv window.

Verify wrote no states (`verify.py`), so the commit rebuilds the accepted node's state: one program
per (request, value head, dv block) loads the committed state block, runs the recurrence over the
tokens on the accepted path (`path[b, i]`: node i is the accepted node or one of its ancestors;
index order is root-first) and stores the block back in place. That is the bytes of one decode step
(read and write one state) whatever N is, against a copy from an N-state scratch that verify would
have had to write first. The same programs copy the accepted node's conv window (a few KiB per
request, so no replay is worth it) from the conv scratch, each its own share, so one launch does both.

It costs about one decode step, far less than the XLA reference; verify plus commit cost well under
the scratch-writing verify plus copy commit they replaced (figures in NOTES.md).

A tracked node (optional `track_node` / `track_dst`: an ancestor of the accepted node, or itself)
also leaves its state and conv window in another pool row: the prefix cache's snapshot of the
prefix ending there, taken on the way without a second replay.

A negative accepted index keeps the slot as it is (nothing is read or written). Both pools alias
the outputs, so with donated pools everything happens in place.

Lowering: Triton (the same reasons as `recurrent.py`; the conv share is a masked slot-indirected copy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn.common import ANY, block_for, cdiv, delta_rule_token, triton_params

CONV_BLOCK = 256  # conv-window elements per program and copy step


def _commit_kernel(
    slots_ref, accepted_ref, path_ref, track_node_ref, track_dst_ref, k_ref, v_ref, g_ref, beta_ref, conv_scr_ref,
    state_ref, conv_ref, state_out_ref, conv_out_ref,
    *, num_draft, block_v, group, use_qk_l2norm, conv_iters,
):
    del conv_ref  # aliased to conv_out_ref; only written
    b = pl.program_id(0)
    h = pl.program_id(1)
    jv = pl.program_id(2)
    hk = h // group
    cols = pl.ds(jv * block_v, block_v)
    a = accepted_ref[b]

    @pl.when(a >= 0)
    def _():
        slot = slots_ref[b]
        last = jnp.minimum(a, num_draft - 1)
        tn = track_node_ref[b]
        dst = track_dst_ref[b]

        def body(i, s):
            def replay():
                return delta_rule_token(s, b * num_draft + i, h, hk, cols, None, k_ref, v_ref, g_ref, beta_ref, None,
                                        scale=1.0, use_qk_l2norm=use_qk_l2norm)
            return jax.lax.cond(path_ref[b, i] != 0, replay, lambda: s)

        # The replay runs in two legs split after the tracked node (a path node, so split <= last + 1),
        # whose state is stored in between: a snapshot costs one extra state write, no second replay.
        split = jnp.where(tn >= 0, jnp.minimum(tn, last) + 1, 0)
        s = jax.lax.fori_loop(0, split, body, state_ref[slot, h, :, cols])

        @pl.when(tn >= 0)
        def _():
            state_out_ref[dst, h, :, cols] = s

        s = jax.lax.fori_loop(split, last + 1, body, s)
        state_out_ref[slot, h, :, cols] = s

        # This program's share of the conv windows: blocks f, f + F, f + 2F, ... of the flat window.
        programs = pl.num_programs(1) * pl.num_programs(2)
        f = h * pl.num_programs(2) + jv
        size = conv_scr_ref.shape[2]

        def copy_window(node, row):
            for it in range(conv_iters):
                off = (f + it * programs) * CONV_BLOCK
                live = off + jnp.arange(CONV_BLOCK) < size
                x = plt.load(conv_scr_ref.at[b, node, pl.ds(off, CONV_BLOCK)], mask=live, other=0.0)
                plt.store(conv_out_ref.at[row, pl.ds(off, CONV_BLOCK)], x.astype(conv_out_ref.dtype), mask=live)

        copy_window(last, slot)

        @pl.when(tn >= 0)
        def _():
            copy_window(jnp.minimum(tn, last), dst)


def commit(state_pool, conv_pool, conv_scratch, k, v, g, beta, slots, path, accepted, track_node=None,
           track_dst=None, *, use_qk_l2norm=True, interpret=False, block_v=32, num_warps=4):
    """Pallas version of `reference.commit` (same arguments and results)."""
    batch, num_draft = path.shape
    if track_node is None:
        track_node = track_dst = jnp.full((batch,), -1, jnp.int32)
    num_k_heads = k.shape[1]
    num_v_heads, dv = v.shape[1:]
    block_v = block_for(dv, block_v)
    programs = num_v_heads * (dv // block_v)
    # Flat conv views: free reshapes of contiguous arrays, so the aliasing stays in place.
    conv_flat = conv_pool.reshape(conv_pool.shape[0], -1)
    conv_scr = conv_scratch.reshape(batch, num_draft, -1)
    conv_iters = cdiv(cdiv(conv_flat.shape[1], CONV_BLOCK), programs)
    kernel = functools.partial(_commit_kernel, num_draft=num_draft, block_v=block_v,
                               group=num_v_heads // num_k_heads, use_qk_l2norm=use_qk_l2norm, conv_iters=conv_iters)
    new_state, new_conv = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
            jax.ShapeDtypeStruct(conv_flat.shape, conv_flat.dtype),
        ),
        grid=(batch, num_v_heads, dv // block_v),
        in_specs=[ANY] * 12,
        out_specs=[ANY] * 2,
        input_output_aliases={10: 0, 11: 1},
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="gdn_commit",
    )(slots.astype(jnp.int32), accepted.astype(jnp.int32), path.astype(jnp.int32), track_node.astype(jnp.int32),
      track_dst.astype(jnp.int32), k, v, g, beta, conv_scr, state_pool, conv_flat)
    return new_state, new_conv.reshape(conv_pool.shape)
