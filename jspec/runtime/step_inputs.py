"""What every jitted step shares: the device state it carries, the bucket it is compiled for, its
packed inputs and the arithmetic each step does on them.

- `DeviceState`: per-engine device buffers, indexed by request slot, donated to every step and
  returned updated. Everything a step needs from earlier steps lives here, so the host can dispatch
  step N+1 before it has read step N's tokens (overlap).
- `Bucket`: the static shapes of one compiled step (T tokens, B requests, U page-table updates).
- `pack` (host) / `Bucket.unpack` (device): one host->device transfer per step, every small input
  in a single int32 vector; floats travel bit-cast. Outputs come back as one int32 matrix.
- Device-side helpers every step uses: page-table updates, KV-slot arithmetic, the token -> request
  map and the `SamplingBatch` of the packed sampling fields.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache.allocator import SINK_SLOT
from jspec.cache.pool import Caches
from jspec.models.batch import ForwardMode
from jspec.runtime.sampler import SamplingBatch
from jspec.runtime.sampling_params import MAX_LOGIT_BIAS
# Prompt chunks of a hybrid target take prefix-cache snapshots inside themselves where the chunked GDN
# kernel's chunks of this many tokens end (at most one per chunk: T // GDN_CHUNK per step).
from pallas_kernels.gdn.common import CHUNK as GDN_CHUNK

if TYPE_CHECKING:
    from jspec.runtime.scheduler import StepPlan

# Per-token kinds (penalty bookkeeping): a prompt token, an output token fed again after a
# retraction, or a decode input that only the device knows (the token it sampled last).
TOKEN_PAD, TOKEN_PROMPT, TOKEN_REFED_OUTPUT, TOKEN_FROM_DEVICE = 0, 1, 2, 3

INT_FIELDS_T = ("input_ids", "positions", "token_kind")
INT_FIELDS_B = ("seq_lens", "req_slots", "has_initial", "sample_mask", "reset_mask", "out_index", "seeds", "top_k",
                "min_new", "top_logprobs_num")
# min_new_tokens holds back at most this many stop tokens per request (EOS ids and stop_token_ids).
MAX_HELD_STOPS = 8
# Decode steps of a hybrid target copy at most this many slots' GDN states into prefix-cache rows: a
# fixed size, since the copy gathers that many state rows per GDN layer every step (one per request
# would move the whole batch's state).
TRACKS_PER_STEP = 4
FLOAT_FIELDS_B = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
FLOAT_FIELDS = FLOAT_FIELDS_B + ("logit_bias_values",)  # float fields of the packed vector (bit-cast)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    """Per-engine device buffers; donated to every step and returned updated (`dataclasses.replace`)."""

    caches: Caches
    req_to_page: jax.Array  # [num_slots, pages_per_seq] int32
    last_token: jax.Array  # [num_slots] int32: the token each request sampled last (its next input)
    output_counts: jax.Array  # [num_slots, V] int32: output tokens so far (frequency/presence penalty)
    prompt_mask: jax.Array  # [num_slots, V] bool: tokens of the prompt (repetition penalty)
    # [num_slots, MAX_LOGIT_BIAS] int32 / float32: the request's biased tokens (-1: none) and biases,
    # written by each of its prompt steps (`logit_bias_ids` / `_values` of the packed input)
    logit_bias_ids: jax.Array
    logit_bias_values: jax.Array
    draft_caches: Caches | None = None  # a drafter's own KV (same page table), when speculating
    # What a drafter carries from one step to the next, per slot (its algorithm defines the keys).
    spec_state: dict | None = None
    # Speculating: each slot's KV length (= the position of its last token), kept on the device so
    # the host can plan step N+1 before it knows how many tokens step N accepted (spec v2).
    seq_lens: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Bucket:
    mode: ForwardMode  # EXTEND or DECODE (a speculative engine's DECODE bucket runs a speculative step)
    num_tokens: int  # T
    batch_size: int  # B
    num_page_updates: int  # U
    sort: bool | None = None  # sampler variant: None decides on device; True / False static
    next_ids: bool = False  # extend steps for a hidden-state drafter: the token after each token
    # A prompt-chunk bucket that also reports the logprob of each token's next token (SGLang's
    # input_token_logprobs; it carries next_ids too): its output has T more rows after the B rows.
    input_logprobs: bool = False
    # A speculative engine's DECODE bucket: False runs the plain step that keeps the drafter
    # current instead of drafting and verifying (see jspec.runtime.adaptive); draft_steps > 0 a
    # shorter chain than configured (0: the configured one).
    speculate: bool = True
    draft_steps: int = 0
    # A hybrid target with prefix-cache snapshots: a prompt-chunk bucket carries the snapshot rows
    # loaded into / saved from each request's GDN state (`state_load`, `state_save` [B]) and, from 64
    # tokens on, the snapshots inside its chunks (`snapshot_tokens`, `snapshot_rows` [T // 64]); a plain
    # decode bucket up to TRACKS_PER_STEP copies of a slot's state into a row (`track_src`, `track_dst`);
    # a speculative engine's decode bucket (commit_tracks) each row's boundary length and snapshot row
    # (`track_at`, `track_dst` [B]), which the GDN commit fills if the accepted run passes that length.
    snapshots: bool = False
    commit_tracks: bool = False
    # Structured output (`jspec.runtime.grammar`): the step takes a token bitmask `[B, grammar_nodes,
    # mask_words]` beside the packed vector (0 nodes: no grammar, no mask input). A decode bucket
    # with grammar_split runs in two parts (`jspec.runtime.split_step`): a speculative one drafts,
    # then takes the host's grammar decisions (`grammar_size` int32) and the masks; a plain one
    # runs its forward, then samples under the masks.
    grammar_nodes: int = 0
    mask_words: int = 0
    grammar_split: bool = False
    grammar_depth: int = 0  # grammar_split: the deepest node acceptance reaches (the drafts per step)
    grammar_pipeline: bool = False  # grammar_split, speculative: the target forward is a part of its own

    @property
    def grammar_size(self) -> int:
        """int32 of a split step's grammar decisions: replaced [B], tokens [B, N-1], walk [B, N]."""
        b, n = self.batch_size, self.grammar_nodes
        return b + b * (n - 1) + b * n

    def fields(self):
        t, b, u = self.num_tokens, self.batch_size, self.num_page_updates
        out = [(name, (t,)) for name in INT_FIELDS_T]
        out.append(("cu_q_lens", (b + 1,)))
        out += [(name, (b,)) for name in INT_FIELDS_B + FLOAT_FIELDS_B]
        out.append(("page_updates", (u, 3)))
        out.append(("held_stops", (b, MAX_HELD_STOPS)))
        if self.mode is ForwardMode.EXTEND:  # a prompt step writes its requests' logit bias into their slots
            out += [("logit_bias_ids", (b, MAX_LOGIT_BIAS)), ("logit_bias_values", (b, MAX_LOGIT_BIAS))]
        if self.snapshots and self.mode is ForwardMode.EXTEND:  # GDN snapshots (rows, -1: none)
            out += [("state_load", (b,)), ("state_save", (b,))]
            if t >= GDN_CHUNK:  # ... and inside the chunks: (token of the step, row)
                out += [("snapshot_tokens", (t // GDN_CHUNK,)), ("snapshot_rows", (t // GDN_CHUNK,))]
        elif self.snapshots and self.commit_tracks:
            out += [("track_at", (b,)), ("track_dst", (b,))]
        elif self.snapshots:
            out += [("track_src", (TRACKS_PER_STEP,)), ("track_dst", (TRACKS_PER_STEP,))]
        if self.next_ids or self.input_logprobs:
            out.append(("next_ids", (t,)))
        return out

    @property
    def label(self) -> str:
        """A short name for progress bars and start-up reports, e.g. "decode B32 k2 sort"."""
        parts = [self.mode.value, f"B{self.batch_size}" if self.mode is ForwardMode.DECODE else
                 f"T{self.num_tokens} B{self.batch_size}"]
        if self.mode is ForwardMode.DECODE and not self.speculate:
            parts.append("plain")
        parts += [f"k{self.draft_steps}"] * bool(self.draft_steps) + ["sort"] * bool(self.sort) + \
            ["input-logprobs"] * self.input_logprobs + ["split"] * self.grammar_split
        return " ".join(parts)

    @functools.cached_property
    def size(self) -> int:
        """int32 of the packed vector (cached: pack asks every step)."""
        return sum(int(np.prod(s)) for _, s in self.fields())

    def unpack(self, packed) -> dict:
        """Device side: int32 `[size]` -> dict of typed arrays (static slices)."""
        out, off = {}, 0
        for name, shape in self.fields():
            n = int(np.prod(shape))
            x = packed[off:off + n].reshape(shape)
            if name in FLOAT_FIELDS:
                x = jax.lax.bitcast_convert_type(x, jnp.float32)
            out[name] = x
            off += n
        return out


def pack(plan: StepPlan, bucket: Bucket) -> np.ndarray:
    """Host side: a step plan -> the bucket's int32 vector (padding rows point at the sinks)."""
    t_cap, b_cap, u_cap = bucket.num_tokens, bucket.batch_size, bucket.num_page_updates
    f = {name: np.zeros(shape, np.int32) for name, shape in bucket.fields() if name not in FLOAT_FIELDS}
    fl = {name: np.zeros(shape, np.float32) for name, shape in bucket.fields() if name in FLOAT_FIELDS}
    f["req_slots"][:] = SINK_SLOT
    f["top_k"][:] = -1
    f["held_stops"][:] = -1
    bias = "logit_bias_ids" in f
    if bias:
        f["logit_bias_ids"][:] = -1
    snapshots = "state_load" in f
    if snapshots:
        f["state_load"][:] = -1
        f["state_save"][:] = -1
    inner = "snapshot_rows" in f
    if inner:
        f["snapshot_rows"][:] = -1
    n_inner = 0
    if "track_dst" in f:
        f["track_dst"][:] = -1
    if "track_src" in f:
        for j, (slot, row) in enumerate(plan.tracks):
            f["track_src"][j], f["track_dst"][j] = slot, row
    fl["top_p"][:] = 1.0
    fl["repetition_penalty"][:] = 1.0
    t = 0
    cu = f["cu_q_lens"]
    for i, s in enumerate(plan.reqs):
        req, sp = s.req, s.req.sampling
        n = s.num_tokens
        if s.token_ids is None:
            f["input_ids"][t] = -1
            f["token_kind"][t] = TOKEN_FROM_DEVICE
        else:
            f["input_ids"][t:t + n] = s.token_ids
            idx = np.arange(s.start, s.start + n)
            f["token_kind"][t:t + n] = np.where(idx < len(req.input_ids), TOKEN_PROMPT, TOKEN_REFED_OUTPUT)
        f["positions"][t:t + n] = np.arange(s.start, s.start + n)
        t += n
        cu[i + 1] = t
        f["seq_lens"][i] = s.start + n
        f["req_slots"][i] = req.slot
        f["has_initial"][i] = s.start > 0
        f["sample_mask"][i] = s.sample
        f["reset_mask"][i] = s.reset
        f["out_index"][i] = s.output_index
        f["seeds"][i] = req.seed
        f["top_k"][i] = sp.top_k
        f["min_new"][i] = sp.min_new_tokens
        f["top_logprobs_num"][i] = req.top_logprobs_num
        f["held_stops"][i, :len(req.held_stops)] = req.held_stops
        if bias and sp.logit_bias:
            ids, values = zip(*sp.logit_bias)
            f["logit_bias_ids"][i, :len(ids)], fl["logit_bias_values"][i, :len(ids)] = ids, values
        if snapshots:
            f["state_load"][i] = s.state_load
            f["state_save"][i] = s.state_save
        if s.inner_snapshots:  # (tokens into the chunk, row): the state after its first k tokens
            assert inner, "inner snapshots planned for a bucket without their fields"
            for k_in, row in s.inner_snapshots:
                # The chunked GDN kernel keeps states only where its 64-token chunks end.
                assert 0 < k_in < n and k_in % GDN_CHUNK == 0, (k_in, n)
                # t is already past this request's n tokens
                f["snapshot_tokens"][n_inner], f["snapshot_rows"][n_inner] = t - n + k_in - 1, row
                n_inner += 1
        if "track_at" in f and s.track is not None:
            f["track_at"][i], f["track_dst"][i] = s.track
        fl["temperature"][i] = 0.0 if sp.is_greedy else sp.temperature
        fl["top_p"][i] = sp.top_p
        fl["min_p"][i] = sp.min_p
        fl["repetition_penalty"][i] = sp.repetition_penalty
        fl["frequency_penalty"][i] = sp.frequency_penalty
        fl["presence_penalty"][i] = sp.presence_penalty
    n_req = len(plan.reqs)
    assert t <= t_cap and n_req <= b_cap, (t, t_cap, n_req, b_cap)
    if bucket.mode is ForwardMode.DECODE:
        # Decode kernels assume one token per row: padding rows own one dummy token each.
        for i in range(n_req, b_cap):
            cu[i + 1] = cu[i] + 1
    else:
        cu[n_req + 1:] = t
    if bucket.next_ids or bucket.input_logprobs:
        # The token after each token (EAGLE-family drafters lag by one); -1 where it is the
        # request's newest token, which only the device has (sampled by this very step).
        nxt = f["next_ids"]
        nxt[:] = -1
        t = 0
        for s in plan.reqs:
            if s.token_ids is not None:  # the known tokens after positions start .. start + n - 1
                after = s.req.all_ids[s.start + 1:s.start + 1 + s.num_tokens]
                nxt[t:t + len(after)] = after
            t += s.num_tokens
    if len(plan.page_updates) > u_cap:
        raise AssertionError(f"{len(plan.page_updates)} page updates exceed the bucket's {u_cap}")
    upd = f["page_updates"]
    upd[:] = -1
    if plan.page_updates:
        upd[:len(plan.page_updates)] = plan.page_updates
    parts = [(fl[name].view(np.int32) if name in FLOAT_FIELDS else f[name]).reshape(-1)
             for name, _ in bucket.fields()]
    out = np.concatenate(parts)
    assert out.size == bucket.size
    return out


@dataclasses.dataclass(frozen=True)
class SpecRows:
    """A speculative engine's decode output, one int32 row per request: [count | width tokens |
    width logprobs | width x num_top top ids | width x num_top top logprobs] (logprobs bit-cast).
    width: the most tokens a step emits (drafts + bonus of the configured chain); every variant of
    the engine's steps (shorter chains, plain steps) writes this layout, padded."""

    width: int
    num_top: int

    @property
    def size(self) -> int:
        return 1 + self.width * (2 + 2 * self.num_top)

    def unpack(self, out: np.ndarray):
        """Host side: `[B, size]` -> count `[B]`, tokens `[B, W]`, logprobs `[B, W]`, top ids and
        top logprobs `[B, W, num_top]`."""
        w, k = self.width, self.num_top
        top = out[:, 1 + 2 * w:]
        return (out[:, 0], out[:, 1:1 + w], out[:, 1 + w:1 + 2 * w].view(np.float32),
                top[:, :w * k].reshape(-1, w, k), top[:, w * k:].reshape(-1, w, k).view(np.float32))


def unpack_outputs(out: np.ndarray, num_top: int):
    """A plain step's `[B, 2 + 2 n]` int32 output -> tokens, logprobs, top ids, top logprobs."""
    tokens = out[:, 0]
    logprobs = out[:, 1].view(np.float32)
    top_ids = out[:, 2:2 + num_top]
    top_lps = out[:, 2 + num_top:2 + 2 * num_top].view(np.float32)
    return tokens, logprobs, top_ids, top_lps


# ----------------------------------------------------------------------------- device-side helpers


def apply_page_updates(req_to_page, updates):
    """Write `[U, 3]` (slot, page index in the request, page id) rows into the page table; rows
    with a negative slot are padding and dropped."""
    slot, idx, page = updates[:, 0], updates[:, 1], updates[:, 2]
    slot = jnp.where(slot < 0, req_to_page.shape[0], slot)
    return req_to_page.at[slot, idx].set(page, mode="drop")


def token_request_index(cu_q_lens, num_tokens: int):
    """Request index `[T]` of every token; tokens past cu_q_lens[B] get B. The binary search is
    unrolled: jnp's default compiles to a while loop, which XLA on GPU leaves in prompt steps, where
    it cuts the step's command buffer in two and launches its body from the host."""
    return jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right",
                            method="scan_unrolled").astype(jnp.int32)


def kv_slots_at(page_table, idx, page_size: int):
    """Flat KV slots (page * L + offset) of KV indices `idx` `[B, M]` through each request's row."""
    page = jnp.take_along_axis(page_table, idx // page_size, axis=1)
    return page * page_size + idx % page_size


def kv_slots(page_table, start, n: int, page_size: int, valid):
    """Flat KV slots `[B, N]` of indices start .. start + N - 1 per request; -1 on padding rows."""
    idx = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    return jnp.where(valid[:, None], kv_slots_at(page_table, idx, page_size), -1)


def sampling_batch(x: dict, step=None, *, state: DeviceState | None = None, slots=None) -> SamplingBatch:
    """The unpacked sampling fields as a `SamplingBatch`; `step` (the index of the token being
    sampled in each request's output) defaults to the packed out_index; with state, each row's
    logit bias from its slot (`slots`, the rows' slots)."""
    bias = {} if state is None else dict(logit_bias_ids=state.logit_bias_ids[slots],
                                         logit_bias_values=state.logit_bias_values[slots])
    return SamplingBatch(**bias,
        temperature=x["temperature"], top_p=x["top_p"], top_k=x["top_k"], min_p=x["min_p"],
        repetition_penalty=x["repetition_penalty"], frequency_penalty=x["frequency_penalty"],
        presence_penalty=x["presence_penalty"], seed=x["seeds"], step=x["out_index"] if step is None else step,
        top_logprobs_num=x["top_logprobs_num"],
    )
