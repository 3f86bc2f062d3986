"""The plain jitted step: packed inputs -> model forward -> on-device sampling -> updated device state.

One function per bucket, for prompt chunks (EXTEND) and, without speculation, decode (DECODE).
Everything a step needs from earlier steps lives in `DeviceState`, indexed by request slot, so
the host can dispatch step N+1 before it has read step N's tokens (overlap) and sends only small
int32 vectors.

A speculative engine's prompt chunks run here too: the target's forward returns what the drafter
reads, and the algorithm's `Drafting.after_extend` brings the drafter along (its KV, carried
state); its decode steps come from `Drafting.make_decode_step` (`jspec/speculative/`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.cache.pool import copy_state_rows
from jspec.models import dispatch, ops
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.runtime import sampler as sampling
from jspec.runtime.step_inputs import (TOKEN_FROM_DEVICE, TOKEN_PAD, TOKEN_PROMPT, TOKEN_REFED_OUTPUT, Bucket,
                                       DeviceState, apply_page_updates, sampling_batch, token_request_index)


@dataclasses.dataclass
class ExtendContext:
    """What a drafter's part of a plain step sees (traced arrays): x the unpacked inputs, batch the
    target's `ForwardBatch`, target the merged target module and out its `ForwardOutput`; tokens `[B]`
    the sampled tokens, sampled `[B]` which rows sampled (their prompt ended), last_token
    `[num_slots]` after this step; per token `[T]`: tok_slot its request's slot, valid whether it is
    real; last_idx `[B]` each request's last token row."""

    x: dict
    batch: ForwardBatch
    target: nnx.Module
    out: object
    tokens: jax.Array
    sampled: jax.Array
    last_token: jax.Array
    tok_slot: jax.Array
    valid: jax.Array
    last_idx: jax.Array
    page_size: int


class Drafting(Protocol):
    """What a speculative algorithm adds to an engine (one per algorithm in `jspec/speculative/`)."""

    draft_model: object  # a loaded Model / DraftModel with graphdef and params, or None (NGRAM)
    kv_ahead: int  # KV indices past a request's length that one speculative step writes
    prefill_ahead: int  # KV indices past a finished prompt that its last prefill step writes
    max_accept: int  # the most tokens one speculative step produces per request
    extend_next_ids: bool  # prompt-chunk buckets carry the token after each token
    shorter_chains: tuple[int, ...]  # draft lengths below the configured one it can also run (adaptive)

    def init_state(self, layout) -> dict | None:
        """The state the drafter carries between steps (`DeviceState.spec_state`), per slot or per
        page of the pool `layout` (`jspec.cache.pool.PoolLayout`)."""

    def target_outputs(self) -> tuple[tuple[int, ...], bool]:
        """(capture_layers, all_hidden) the target's prompt forward must return for the drafter."""

    def after_extend(self, draft, ctx: ExtendContext, draft_caches, spec_state):
        """The drafter's part of a prompt chunk -> (draft_caches, spec_state)."""

    def grammar_nodes(self, draft_steps: int) -> tuple[int, int]:
        """(verified nodes, deepest accepted node) of a speculative step, for grammar masks."""

    def rows(self, num_top: int):
        """The `SpecRows` layout of this engine's decode outputs, num_top top logprobs per token."""

    def make_decode_step(self, graphdef, bucket: Bucket, *, page_size: int, num_top_logprobs: int):
        """The decode step for a DECODE bucket: (params, state, packed) -> (state, out); the
        speculative step (`bucket.draft_steps` drafts per request when > 0), or with
        `bucket.speculate` False a plain one that keeps the drafter current; out: `SpecRows`
        with num_top_logprobs top logprobs per emitted token."""


def make_step(graphdef, bucket: Bucket, *, page_size: int, num_top_logprobs: int, drafting: Drafting | None = None):
    """The step function for one bucket: (params, DeviceState, packed int32[, vocab_mask]) ->
    (DeviceState, out); vocab_mask `[B, 1, W]`: a grammar bucket's token bitmasks (`grammar.py`).

    out `[B, 2 + 2 n_top]` int32: the sampled token (-1 where the row did not sample), its logprob
    and the top logprobs (bit-cast floats). With a drafter that has weights, params is (target
    params, draft params).

    A plain decode bucket with `grammar_split` gets a `SplitSample` instead: the forward, then the
    sampling with masks the host computes while the forward runs."""
    draft_graphdef = None if drafting is None or drafting.draft_model is None else drafting.draft_model.graphdef
    capture_layers, all_hidden = ((), False) if drafting is None else drafting.target_outputs()

    def front(params, state: DeviceState, packed) -> dict:
        """The forward: every value the sampling half reads (traced arrays and the merged modules)."""
        draft_params = None
        if draft_graphdef is not None:
            params, draft_params = params
        x = bucket.unpack(packed)
        req_to_page = apply_page_updates(state.req_to_page, x["page_updates"])
        slots, cu, pos = x["req_slots"], x["cu_q_lens"], x["positions"]

        # Token -> request; tokens past cu[B] are padding.
        req_of_tok = token_request_index(cu, bucket.num_tokens)
        valid_tok = req_of_tok < bucket.batch_size
        tok_slot = slots[jnp.minimum(req_of_tok, bucket.batch_size - 1)]
        kind = jnp.where(valid_tok, x["token_kind"], TOKEN_PAD)
        input_ids = jnp.where(kind == TOKEN_FROM_DEVICE, state.last_token[tok_slot], x["input_ids"])
        input_ids = jnp.where(valid_tok, input_ids, 0)

        page_table = req_to_page[slots]  # [B, pages_per_seq]
        page = jnp.take_along_axis(req_to_page[tok_slot], (pos // page_size)[:, None], axis=1)[:, 0]
        # Decode padding rows own one dummy token each; their slot's page-table row is all sink
        # pages, so its KV lands in page 0, which no request reads.
        slot_mapping = jnp.where(valid_tok, page * page_size + pos % page_size, -1)
        batch = ForwardBatch(
            input_ids=input_ids, positions=pos, seq_lens=x["seq_lens"], cu_q_lens=cu, page_table=page_table,
            slot_mapping=slot_mapping, state_slots=slots, has_initial_state=x["has_initial"] > 0,
            snapshot_tokens=x.get("snapshot_tokens"), snapshot_rows=x.get("snapshot_rows"), mode=bucket.mode,
        )
        last_idx = jnp.maximum(cu[1:] - 1, 0)
        target = nnx.merge(graphdef, params)
        caches = state.caches
        extend_snapshots = bucket.snapshots and bucket.mode is ForwardMode.EXTEND
        if extend_snapshots:  # hybrid prefix cache: a cached GDN state into the slot of a request that reuses it
            load = x["state_load"]
            caches = copy_state_rows(caches, load, jnp.where(load >= 0, slots, -1))
        out, caches = target(batch, caches, logits_indices=last_idx, capture_layers=capture_layers,
                             all_hidden=all_hidden or bucket.input_logprobs)
        if extend_snapshots:  # ... and the state a chunk ends with into a snapshot row
            caches = copy_state_rows(caches, slots, x["state_save"])
        elif bucket.snapshots:  # decode: the states of requests whose length reached a tracked boundary
            caches = copy_state_rows(caches, x["track_src"], x["track_dst"])
        return dict(x=x, slots=slots, req_to_page=req_to_page, caches=caches, logits=out.logits, target=target,
                    out=out, batch=batch, draft_params=draft_params, req_of_tok=req_of_tok, valid_tok=valid_tok,
                    tok_slot=tok_slot, kind=kind, input_ids=input_ids, last_idx=last_idx)

    def back(state: DeviceState, f: dict, vocab_mask):
        """Penalty state, masks, sampling, the drafter's part and the output rows."""
        x, slots, caches, req_to_page = f["x"], f["slots"], f["caches"], f["req_to_page"]
        # Penalty state: reset on (re)admission, then count this step's prompt / re-fed tokens.
        # Only extend steps admit requests or feed prompts, so decode steps skip these [B, V] scatters.
        counts, prompt_mask = state.output_counts, state.prompt_mask
        if bucket.mode is ForwardMode.EXTEND:
            tok_slot, kind, input_ids = f["tok_slot"], f["kind"], f["input_ids"]
            counts, prompt_mask = sampling.reset_slots(counts, prompt_mask,
                                                       jnp.where(x["reset_mask"] > 0, slots, counts.shape[0]))
            prompt_mask = sampling.add_prompt_tokens(prompt_mask, tok_slot, input_ids, kind == TOKEN_PROMPT)
            counts = sampling.update_counts(counts, tok_slot, input_ids, kind == TOKEN_REFED_OUTPUT)
            counts, prompt_mask = dispatch.whole(counts), dispatch.whole(prompt_mask)
            # Each prompt step (re)writes its requests' logit bias (padding rows: the sink slot's).
            state = dataclasses.replace(state, logit_bias_ids=state.logit_bias_ids.at[slots].set(x["logit_bias_ids"]),
                                        logit_bias_values=state.logit_bias_values.at[slots].set(x["logit_bias_values"]))

        logits = f["logits"] if vocab_mask is None else sampling.apply_bitmask(f["logits"], vocab_mask[:, 0])
        logits = sampling.hold_stops(logits[:, None], x["out_index"][:, None], x["min_new"], x["held_stops"])[:, 0]
        so = sampling.sample(logits, sampling_batch(x, state=state, slots=slots), counts[slots], prompt_mask[slots],
                             num_top_logprobs=num_top_logprobs, sort=bucket.sort, vocab_shards=f["target"].tp_size)
        sampled = x["sample_mask"] > 0
        counts = sampling.update_counts(counts, slots, so.tokens, sampled)
        write_slot = jnp.where(sampled, slots, state.last_token.shape[0])
        last_token = state.last_token.at[write_slot].set(so.tokens, mode="drop")
        new = dataclasses.replace(state, caches=caches, req_to_page=req_to_page, last_token=last_token,
                                  output_counts=counts, prompt_mask=prompt_mask)
        if drafting is not None:
            # A finished prompt's sampled token sits at KV index seq_len: the speculative steps
            # read each request's length on the device.
            seq_lens = state.seq_lens.at[write_slot].set(x["seq_lens"], mode="drop")
            draft = None if draft_graphdef is None else nnx.merge(draft_graphdef, f["draft_params"])
            ctx = ExtendContext(x=x, batch=f["batch"], target=f["target"], out=f["out"], tokens=so.tokens,
                                sampled=sampled, last_token=last_token, tok_slot=f["tok_slot"], valid=f["valid_tok"],
                                last_idx=f["last_idx"], page_size=page_size)
            draft_caches, spec_state = drafting.after_extend(draft, ctx, state.draft_caches, state.spec_state)
            new = dataclasses.replace(new, seq_lens=seq_lens, draft_caches=draft_caches, spec_state=spec_state)

        tokens = jnp.where(sampled, so.tokens, -1).astype(jnp.int32)
        packed_out = _rows(tokens, so.logprobs, so.top_ids, so.top_logprobs)
        if bucket.input_logprobs:  # T more rows: each token's next token and its logprob there
            valid_tok = f["valid_tok"]
            row = jnp.minimum(f["req_of_tok"], bucket.batch_size - 1)
            nxt = jnp.where(valid_tok, x["next_ids"], -1)
            lp, top_ids, top_lp = input_logprobs(f["target"], f["out"].final_hidden, nxt, x["temperature"][row],
                                                 num_top_logprobs, top_wanted=x["top_logprobs_num"][row] > 0)
            packed_out = jnp.concatenate([packed_out, _rows(nxt, lp, top_ids, top_lp)], axis=0)
        return new, packed_out

    def step(params, state: DeviceState, packed, vocab_mask=None):
        return back(state, front(params, state, packed), vocab_mask)

    if not bucket.grammar_split:
        return step
    # Only what a plain decode step's sampling half reads crosses between the halves.
    assert bucket.mode is ForwardMode.DECODE and drafting is None, bucket

    def forward(params, state: DeviceState, packed):
        f = front(params, state, packed)
        return dataclasses.replace(state, caches=f["caches"], req_to_page=f["req_to_page"]), f["logits"]

    def sample(params, state: DeviceState, packed, logits, vocab_mask):
        x = bucket.unpack(packed)
        f = dict(x=x, slots=x["req_slots"], caches=state.caches, req_to_page=state.req_to_page, logits=logits,
                 target=nnx.merge(graphdef, params))
        return back(state, f, vocab_mask)

    return SplitSample(forward=forward, sample=sample)


@dataclasses.dataclass(frozen=True)
class SplitSample:
    """A plain decode step in two halves, for structured output: `forward(params, state, packed)
    -> (state, logits [B, V])` and `sample(params, state, packed, logits, vocab_mask) -> (state,
    out)`. The loop launches the forward before it reads the previous step, whose tokens the
    grammar masks depend on (`jspec.runtime.split_step`)."""

    forward: object
    sample: object


def _rows(tokens, logprobs, top_ids, top_logprobs):
    """`[R, 2 + 2 n_top]` int32 output rows (floats bit-cast)."""
    bits = lambda v: jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.concatenate([tokens[:, None].astype(jnp.int32), bits(logprobs)[:, None],
                            top_ids.astype(jnp.int32), bits(top_logprobs)], axis=1)


INPUT_LOGPROB_BYTES = 512 << 20  # float32 logits of one block of tokens, live at once


def input_logprob_block(vocab_size: int) -> int:
    """Tokens per block of `input_logprobs`: the most, a power of two from 16 to 1024, whose
    float32 logits fit in INPUT_LOGPROB_BYTES. Small blocks read the whole LM head once per few
    rows (a 2048-token chunk in blocks of 128 read it 16 times), while the logits' bytes grow with
    the block."""
    rows = max(16, min(1024, INPUT_LOGPROB_BYTES // (4 * vocab_size)))
    return 1 << (rows.bit_length() - 1)


def input_logprobs(target, hidden, next_ids, temperature, num_top: int, block: int | None = None, top_wanted=None):
    """SGLang's input_token_logprobs: for each of the T tokens, log_softmax(logits / T) (T = 1 for
    greedy rows; no penalties, as SGLang) of the token after it (next_ids `[T]`, -1: none) and the
    top num_top, from the final hidden states `[T, E]`, `block` tokens at a time
    (`input_logprob_block` by default) so a long chunk never holds `[T, V]` logits. Every block
    runs, a chunk's padding too: a loop that stopped after the last token with a next token would
    need its trip count on the host, a sync in the middle of the step on a GPU (XLA's while loop
    reads its condition back each iteration unless the trip count is static). top_wanted (`[T]`
    bool, None: all): the tokens whose top logprobs are returned; the others' top rows are zeros
    and the top-k kernel skips them."""
    t = hidden.shape[0]
    vocab = jax.eval_shape(target.compute_logits, hidden[:1]).shape[-1]
    rows = min(block or input_logprob_block(vocab), t)
    blocks = -(-t // rows)
    pad = blocks * rows - t

    def one(args):
        h, nxt, tb, *want = args
        lp = sampling.logprobs_at_temperature(target.compute_logits(h), tb)
        chosen = ops.vocab_take(lp, jnp.maximum(nxt, 0)[:, None], tp=target.tp_size)[:, 0]
        if num_top > 0:
            top_lp, top_ids = ops.vocab_top_k(lp, num_top, tp=target.tp_size, rows=want[0] if want else None)
        else:
            top_lp, top_ids = jnp.zeros((h.shape[0], 0), jnp.float32), jnp.zeros((h.shape[0], 0), jnp.int32)
        return chosen, top_ids.astype(jnp.int32), top_lp

    split = lambda v: jnp.pad(v, ((0, pad),) + ((0, 0),) * (v.ndim - 1)).reshape(  # noqa: E731
        (blocks, rows) + v.shape[1:])
    xs = (split(hidden), split(next_ids), split(temperature))
    if top_wanted is not None:
        xs += (split(top_wanted & (next_ids >= 0)),)
    lp, top_ids, top_lp = jax.lax.map(one, xs)
    merge = lambda v: v.reshape((blocks * rows,) + v.shape[2:])[:t]  # noqa: E731
    return merge(lp), merge(top_ids), merge(top_lp)


def with_flat_params(fn, treedef):
    """A step function (or a split step's parts) that takes the parameters as the flat tuple of
    their arrays and rebuilds their tree (`treedef`) while tracing. Every call flattens its
    arguments: a tuple of arrays flattens in C++, while flax's `State` and `Param` nodes flatten
    in Python, leaf by leaf, on every call (bench/README.md,
    "parameters as a flat tuple")."""
    def wrap(f):
        @functools.wraps(f)
        def call(leaves, *args):
            return f(jax.tree_util.tree_unflatten(treedef, leaves), *args)
        return call

    if dataclasses.is_dataclass(fn):  # SplitSample / SplitStep: every part takes the parameters first
        return dataclasses.replace(fn, **{f.name: wrap(getattr(fn, f.name)) for f in dataclasses.fields(fn)
                                          if callable(getattr(fn, f.name))})
    return wrap(fn)
