"""The target's verify forward and the commit of its hybrid state, shared by every drafter.

Each request verifies N tokens: node 0 is its last token (sampled last step, not yet in the KV)
and nodes 1..N-1 are draft tokens. Node j's KV goes to index L0 + j (L0 = the request's current
length), its RoPE position is L0 + depth(j); a chain has depth(j) = j and needs no mask (causal),
a tree passes its ancestor mask. Gated-DeltaNet layers run in verify mode: the slot's state is
not touched, and `commit` afterwards replays the accepted path's tokens over it (and copies the
accepted node's conv window). So rejection costs nothing to undo: rejected KV lies past the new
length and is overwritten later; rejected states are never built.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.cache.pool import Caches
from jspec.models import ops
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.runtime.step_inputs import kv_slots
from pallas_kernels.gdn import reference as gdn_ref


def chain_parents(batch_size: int, n: int):
    """`[B, N]`: node j's parent is j - 1; the root continues from the committed state (-1)."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (batch_size, n))


def verify_batch(tokens, l0, valid, page_table, slots, page_size: int, *, depth=None, parents=None,
                 tree_mask=None) -> ForwardBatch:
    """ForwardBatch for tokens `[B, N]` verified at KV indices l0 .. l0 + N - 1."""
    b, n = tokens.shape
    depth = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)) if depth is None else depth
    return ForwardBatch(
        input_ids=tokens.reshape(-1), positions=(l0[:, None] + depth).reshape(-1),
        seq_lens=jnp.where(valid, l0 + n, 0), cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32) * n,
        page_table=page_table, slot_mapping=kv_slots(page_table, l0, n, page_size, valid).reshape(-1),
        state_slots=slots, has_initial_state=valid,
        parents=chain_parents(b, n) if parents is None else parents, tree_mask=tree_mask, mode=ForwardMode.VERIFY,
    )


def extend_batch(tokens, l0, valid, page_table, slots, page_size: int) -> ForwardBatch:
    """A causal extend of tokens `[B, N]` at positions l0 .. l0 + N - 1 (the drafter's catch-up)."""
    b, n = tokens.shape
    pos = l0[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    return ForwardBatch(
        input_ids=tokens.reshape(-1), positions=pos.reshape(-1), seq_lens=jnp.where(valid, l0 + n, 0),
        cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32) * n, page_table=page_table,
        slot_mapping=kv_slots(page_table, l0, n, page_size, valid).reshape(-1), state_slots=slots,
        has_initial_state=valid, mode=ForwardMode.EXTEND,
    )


def decode_batch(tokens, pos, valid, page_table, slots, page_size: int) -> ForwardBatch:
    """One token per request at position `pos` `[B]` (a draft step)."""
    return ForwardBatch(
        input_ids=tokens, positions=pos, seq_lens=jnp.where(valid, pos + 1, 0),
        cu_q_lens=jnp.arange(tokens.shape[0] + 1, dtype=jnp.int32), page_table=page_table,
        slot_mapping=kv_slots(page_table, pos, 1, page_size, valid)[:, 0], state_slots=slots,
        has_initial_state=valid, mode=ForwardMode.DECODE,
    )


def commit(caches: Caches, scratch, slots, accepted, parents=None, *, track=None, tp: int = 1) -> Caches:
    """Make node `accepted[b]` the committed GDN state of slot `slots[b]` (negative: keep).
    parents `[B, N]` of a tree; None for a chain. track: None or (node, row) `[B]` each, a node on
    the accepted path whose state also goes to snapshot row `row` (node -1: none; the prefix cache's
    decode-time snapshots). tp: the target's tensor-parallel size."""
    if not scratch:
        return caches
    if parents is None:
        parents = chain_parents(accepted.shape[0], scratch[0][0].shape[1])
    if track is None:
        track = (jnp.full_like(accepted, -1), jnp.full_like(accepted, -1))
    path = gdn_ref.accepted_path(parents, accepted)  # once for every layer
    conv, ssm = list(caches.conv), list(caches.ssm)
    for i, (conv_scr, replay) in enumerate(scratch):
        ssm[i], conv[i] = ops.gdn_commit(ssm[i], conv[i], conv_scr, replay, slots, path, accepted, *track, tp=tp)
    return Caches(kv=caches.kv, conv=conv, ssm=ssm)
