"""What a model forward is asked to do: the forward mode and the step's ragged tokens.

`ForwardMode` is the one vocabulary of step kinds, shared by the scheduler (what a step plan
does), the buckets (what a compiled step does) and the models (which kernels run). `ForwardBatch`
carries the small int32 arrays that describe one step's ragged tokens; it is a plain pytree, so a
jitted step builds it from its packed inputs. The pools a forward reads and writes are
`jspec.cache.pool.Caches`.
"""

from __future__ import annotations

import dataclasses
import enum

import jax


class ForwardMode(enum.Enum):
    """EXTEND: prompt chunks (and a drafter's catch-up), any number of tokens per request.
    DECODE: exactly one token per request (T == B); a speculative engine's decode step drafts,
    verifies and accepts inside it. VERIFY: exactly N draft tokens per request (T == B * N), causal
    or tree-masked; Gated-DeltaNet layers leave the state pool untouched (see `ForwardBatch`)."""

    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    """T new tokens ragged over B requests (see pallas_kernels/paged_attention/reference.py).

    input_ids, positions, slot_mapping: [T]; seq_lens, state_slots, has_initial_state: [B];
    cu_q_lens: [B + 1]; page_table: [B, pages_per_seq]. `mode` (static, `ForwardMode`): EXTEND
    (prefill chunks, any q_len), DECODE (exactly one token per request, T == B) or VERIFY (exactly
    N draft tokens per request, T == B * N: attention is causal, or follows `tree_mask` [B, N, N];
    Gated-DeltaNet layers leave the state pool untouched and return the state after every draft
    token, each continuing from its parent's, `parents` [B, N] with -1 = the committed state).
    In verify mode `positions` are the RoPE positions (a tree node's depth past the prefix) while
    `slot_mapping` places node j at KV index seq_len - N + j, the order the tree mask uses.
    snapshot_tokens, snapshot_rows `[S]` (EXTEND, hybrid prefix cache; rows -1 = none): the
    Gated-DeltaNet state (recurrent state and conv window) after token snapshot_tokens[i] of this
    step also goes to state-pool row snapshot_rows[i]; each such token ends one of the chunked
    kernel's 64-token chunks of its request.
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
    snapshot_tokens: jax.Array | None = None
    snapshot_rows: jax.Array | None = None
    mode: ForwardMode = dataclasses.field(default=ForwardMode.EXTEND, metadata=dict(static=True))

    def __post_init__(self):
        # A string here would compare unequal to every mode and silently run the extend path.
        if not isinstance(self.mode, ForwardMode):
            raise TypeError(f"ForwardBatch.mode must be a ForwardMode, got {self.mode!r}")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]
