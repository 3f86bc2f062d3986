"""Step inputs and caches as typed pytrees.

`ForwardBatch` carries the small int32 arrays that describe one step's ragged tokens; `Caches`
carries the paged KV pool (one K and one V array per attention layer) and the Gated-DeltaNet state
pool (one conv window and one recurrent state array per GDN layer). Both are plain pytrees, so a
jitted step takes them as arguments and donates the caches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MODES = ("extend", "decode", "verify")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    """T new tokens ragged over B requests (see pallas_kernels/paged_attention/reference.py).

    input_ids, positions, slot_mapping: [T]; seq_lens, state_slots, has_initial_state: [B];
    cu_q_lens: [B + 1]; page_table: [B, pages_per_seq]. `mode` is static: "extend" (prefill
    chunks, any q_len), "decode" (exactly one token per request, T == B) or "verify" (exactly N
    draft tokens per request, T == B * N: attention is causal, or follows `tree_mask` [B, N, N];
    Gated-DeltaNet layers leave the state pool untouched and return the state after every draft
    token, each continuing from its parent's, `parents` [B, N] with -1 = the committed state).
    In verify mode `positions` are the RoPE positions (a tree node's depth past the prefix) while
    `slot_mapping` places node j at KV index seq_len - N + j, the order the tree mask uses.
    """

    input_ids: jax.Array
    positions: jax.Array
    seq_lens: jax.Array
    cu_q_lens: jax.Array
    page_table: jax.Array
    slot_mapping: jax.Array
    state_slots: jax.Array
    has_initial_state: jax.Array
    parents: jax.Array | None = None
    tree_mask: jax.Array | None = None
    mode: str = dataclasses.field(default="extend", metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Caches:
    """kv[i] = (k_pages, v_pages) `[P, L, G, D]` for the i-th attention layer;
    conv[j] `[S, C, K-1]` and ssm[j] `[S, Hv, dk, dv]` (float32) for the j-th GDN layer."""

    kv: list
    conv: list
    ssm: list


def empty_caches(config, *, num_pages: int, page_size: int, num_state_slots: int, dtype) -> Caches:
    """Allocate zeroed pools for a model config."""
    kv = [
        (
            jnp.zeros((num_pages, page_size, config.num_key_value_heads, config.head_dim), dtype),
            jnp.zeros((num_pages, page_size, config.num_key_value_heads, config.head_dim), dtype),
        )
        for _ in config.attention_layer_ids
    ]
    conv, ssm = [], []
    for _ in config.gdn_layer_ids:
        conv.append(jnp.zeros((num_state_slots, config.gdn_conv_dim, config.linear_conv_kernel_dim - 1), dtype))
        ssm.append(
            jnp.zeros(
                (
                    num_state_slots,
                    config.linear_num_value_heads,
                    config.linear_key_head_dim,
                    config.linear_value_head_dim,
                ),
                jnp.float32,
            )
        )
    return Caches(kv=kv, conv=conv, ssm=ssm)
