"""What every speculative decode step shares: its carry, how it starts, how it ends, how phases compose.

A speculative step is one jitted function per batch bucket, written as a list of named phases
(draft -> verify -> accept -> drafter catch-up) over one `SpecStep` carry that each phase fills in
while the step is traced. `compose` runs them all: that is the engine's step. A benchmark composes
a prefix of them itself to time the phases (bench/spec_eagle.py); the steps know nothing of that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.runtime import sampler as sampling
from jspec.runtime.step_inputs import Bucket, DeviceState, SpecRows, apply_page_updates, sampling_batch
from jspec.speculative import accept, grammar_nodes, penalties, verify


@dataclasses.dataclass
class SpecStep:
    """The carry of one speculative step (traced arrays; B = the bucket's batch size).

    Set by `begin`: x (unpacked inputs), req_to_page (page updates applied), slots / valid / l0 `[B]`
    (each request's slot, whether the row is real, the KV index of its last token, which is not
    in the KV yet), page_table `[B, pages_per_seq]`, sb (its SamplingBatch), greedy `[B]`, key_fn,
    last `[B]` (the last token, the root of what is verified), target / drafter (merged modules;
    drafter None without draft weights), and caches / draft_caches / spec_state, which phases update.
    Set by the phases: drafts `[B, S]`, kept `[B, S]` (accepted drafts, valid up to n), n `[B]`
    (kept drafts), bonus `[B]`, and what a phase hands the next (`scratch`)."""

    bucket: Bucket
    page_size: int
    state: DeviceState
    x: dict
    req_to_page: jax.Array
    slots: jax.Array
    valid: jax.Array
    l0: jax.Array
    page_table: jax.Array
    sb: sampling.SamplingBatch
    greedy: jax.Array
    key_fn: Callable
    last: jax.Array
    target: nnx.Module
    drafter: nnx.Module | None
    caches: object
    draft_caches: object
    spec_state: dict | None
    drafts: jax.Array | None = None
    kept: jax.Array | None = None
    n: jax.Array | None = None
    bonus: jax.Array | None = None
    scratch: dict = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.bucket.batch_size


Phase = tuple[str, Callable[[SpecStep], None]]


def begin(bucket: Bucket, graphdef, draft_graphdef, *, page_size: int, num_keys: int):
    """(params, state, packed) -> SpecStep. num_keys: random uses per request per step (key_fn(k),
    k < num_keys). With draft weights params is (target params, draft params). The returned
    function's `resume(params, carry)` rebuilds a SpecStep from `carry(c)` (a step in two parts)."""

    def modules(params):
        target_params, draft_params = params if draft_graphdef is not None else (params, None)
        return (nnx.merge(graphdef, target_params),
                None if draft_graphdef is None else nnx.merge(draft_graphdef, draft_params))

    def key_fn_of(x, out_index):
        def key_fn(k: int):
            # One stream per request, indexed by (index of the step's first output, use k): the same
            # tokens whatever else is in the batch.
            return jax.vmap(lambda sd, st: sampling.row_key(sd, st * num_keys + k))(x["seeds"], out_index)

        return key_fn

    def start(params, state: DeviceState, packed, vocab_mask=None) -> SpecStep:
        x = bucket.unpack(packed)
        if vocab_mask is not None:  # structured output: `[B, M, W]` token bitmasks of nodes 0..M-1
            x["vocab_mask"] = vocab_mask
        req_to_page = apply_page_updates(state.req_to_page, x["page_updates"])
        slots = x["req_slots"]
        valid = x["seq_lens"] > 0  # padding rows carry seq_len 0
        # KV index of each request's last token, from the device: with overlap the host plans this
        # step before it knows what the previous one accepted. Its output index moves with it, so it
        # is the host's (output index - position) plus the device's position.
        l0 = jnp.where(valid, state.seq_lens[slots], 0)
        out_index = l0 + x["out_index"] - x["positions"][:bucket.batch_size]
        target, drafter = modules(params)
        return SpecStep(
            bucket=bucket, page_size=page_size, state=state, x=x, req_to_page=req_to_page, slots=slots, valid=valid,
            l0=l0, page_table=req_to_page[slots], sb=sampling_batch(x, step=out_index, state=state, slots=slots),
            greedy=x["temperature"] < sampling.GREEDY_TEMPERATURE, key_fn=key_fn_of(x, out_index),
            last=state.last_token[slots], target=target, drafter=drafter,
            caches=state.caches, draft_caches=state.draft_caches, spec_state=state.spec_state,
        )

    def resume(params, buffers: dict, rest: dict) -> SpecStep:
        target, drafter = modules(params)
        return SpecStep(bucket=bucket, page_size=page_size, key_fn=key_fn_of(rest["x"], rest["sb"].step),
                        target=target, drafter=drafter, **buffers, **rest)

    start.bucket, start.resume = bucket, resume
    return start


# SpecStep fields that are not arrays: rebuilt by `resume`, never carried between the two parts.
_REBUILT = ("bucket", "page_size", "key_fn", "target", "drafter")


_BUFFERS = ("state", "caches", "draft_caches", "spec_state")  # donated from one part to the next


def carry(c: SpecStep) -> tuple[dict, dict]:
    """The arrays of a SpecStep between the two parts of a split step: (the device state's buffers,
    donated and updated in place; everything else). The pools travel once, in caches /
    draft_caches / spec_state, not again inside the state they came from."""
    out = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in _REBUILT}
    out["state"] = dataclasses.replace(c.state, caches=None, draft_caches=None, spec_state=None)
    fwd = c.scratch.get("out")
    if "logits" in c.scratch and getattr(fwd, "logits", None) is not None:
        # The verify logits travel once, as scratch["logits"] (the forward's, reshaped), which the
        # later phases read; at a large vocabulary they are most of the carry's bytes.
        out["scratch"] = dict(c.scratch, out=dataclasses.replace(fwd, logits=None))
    return {k: out.pop(k) for k in _BUFFERS}, out


def finish(c: SpecStep, rows: SpecRows) -> tuple[DeviceState, jax.Array]:
    """The state after the step (the bonus is each request's next input; its KV length moves past
    its last token and the n kept drafts; the emitted tokens join the penalty counts) and the
    output rows `[B, rows.size]` (`SpecRows`): the emitted tokens and their logprobs under the
    penalised target distribution at the node that drew each (c.scratch["path_logits"])."""
    b, s = c.kept.shape
    at = jnp.where(c.valid, c.slots, c.state.last_token.shape[0])
    j = jnp.arange(s + 1)[None, :]
    emitted = jnp.where(j < c.n[:, None], jnp.pad(c.kept, ((0, 0), (0, 1))), c.bonus[:, None])  # [B, S+1]
    live = (j <= c.n[:, None]) & c.valid[:, None]
    new = dataclasses.replace(
        c.state, caches=c.caches, req_to_page=c.req_to_page, draft_caches=c.draft_caches, spec_state=c.spec_state,
        last_token=c.state.last_token.at[at].set(c.bonus, mode="drop"),
        seq_lens=c.state.seq_lens.at[at].set(c.l0 + c.n + 1, mode="drop"),
        output_counts=sampling.update_counts(c.state.output_counts, c.slots, emitted, live),
    )
    lp, top_ids, top_lp = penalties.path_logprobs(c.scratch["path_logits"], emitted, c.sb, rows.num_top,
                                                  vocab_shards=c.target.tp_size)
    pad = rows.width - (s + 1)
    widen = lambda x, v: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=v)  # noqa: E731
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).reshape(b, -1)  # noqa: E731
    tokens = accept.output_rows(c.kept, c.n, c.bonus, c.valid)  # [B, S+2]: count, tokens
    out = jnp.concatenate([widen(tokens, -1), bits(widen(lp, 0.0)), widen(top_ids, -1).reshape(b, -1),
                           bits(widen(top_lp, 0.0))], axis=1)
    return new, out


def penalised(c: SpecStep, logits, tokens, ancestors, depth=None):
    """Verify logits `[B, N, V]` under each request's penalties as they stand at every node
    (`penalties.penalise_nodes`; tokens `[B, N]` the nodes' tokens, ancestors `[B, N, N]`) and its
    logit bias, its stop tokens held back where the node's output index is below min_new_tokens (depth `[B, N]`:
    a tree's node depths; None: a chain's, the node index), and under the grammar masks of the
    first M nodes when the bucket has them."""
    out = penalties.penalise_nodes(logits.astype(jnp.float32), c.sb, c.state.output_counts[c.slots],
                                   c.state.prompt_mask[c.slots], tokens, ancestors, tp=c.target.tp_size)
    out = sampling.add_logit_bias(out, c.sb, tp=c.target.tp_size)
    depth = jnp.arange(out.shape[1])[None, :] if depth is None else depth
    out = sampling.hold_stops(out, c.sb.step[:, None] + depth, c.x["min_new"], c.x["held_stops"])
    if "vocab_mask" in c.x:
        m = c.x["vocab_mask"].shape[1]
        out = jnp.concatenate([sampling.apply_bitmask(out[:, :m], c.x["vocab_mask"]), out[:, m:]], axis=1)
    return out


def grammar_limit(c: SpecStep, *, allowed_only: bool = False):
    """`[B]` how many drafts each row may try (`grammar_nodes.chain_limit`), or None when the step
    has no grammar inputs."""
    if "walk" not in c.scratch:
        return None
    return grammar_nodes.chain_limit(c.scratch["walk"], allowed_only=allowed_only)


def walk_parents(c: SpecStep, parents):
    """The parents a tree's acceptance walks (`grammar_nodes.walk_parents`)."""
    return parents if "walk" not in c.scratch else grammar_nodes.walk_parents(parents, c.scratch["walk"])


def apply_grammar(c: SpecStep, grammar, masks, *, replace: bool = True) -> None:
    """The host's decisions about the drafts (`grammar_nodes`), before acceptance: packed int32
    `[B + B*D + B*N]` (replaced, tokens, walk) and masks `[B, N, W]`. replace: also put the forced
    runs in place of the drafts (False: a pipelined step's forward part did)."""
    b, d = c.drafts.shape
    c.x["vocab_mask"] = masks
    c.scratch["walk"] = grammar[b + b * d:].reshape(b, d + 1)
    if replace:
        replace_drafts(c, grammar)


def replace_drafts(c: SpecStep, grammar) -> None:
    """The replaced rows' forced runs in place of their drafts (before the target's forward)."""
    b, d = c.drafts.shape
    replaced = grammar[:b] > 0
    tokens = grammar[b:b + b * d].reshape(b, d)
    walk = grammar[b + b * d:].reshape(b, d + 1)
    if "parents" in c.scratch:
        c.drafts, c.scratch["parents"], c.scratch["depth"] = grammar_nodes.override_tree(
            c.drafts, c.scratch["parents"], c.scratch["depth"], replaced, tokens, walk)
    else:
        c.drafts, q = grammar_nodes.override_chain(c.drafts, c.scratch.get("q"), replaced, tokens)
        if q is not None:
            c.scratch["q"] = q


def accept_chain(c: SpecStep, *, q=None, simulate_accept_length: float | None = None) -> None:
    """The accept phase of a chain: c.drafts `[B, S]` against c.scratch["logits"] `[B, S+1, V]`
    (q: the drafter's distributions, None for point masses; simulate_accept_length: benchmarks),
    then the accepted node's Gated-DeltaNet state is committed. Sets n, bonus and kept."""
    nodes = jnp.concatenate([c.last[:, None], c.drafts], axis=1)
    logits = penalised(c, c.scratch["logits"], nodes, penalties.chain_ancestors(*nodes.shape))
    c.scratch["path_logits"] = logits  # node j drew the j-th emitted token
    if simulate_accept_length is None:
        c.n, c.bonus = accept.chain(logits, c.drafts, q, c.sb, c.greedy, c.key_fn, sort=c.bucket.sort,
                                    limit=grammar_limit(c), tp=c.target.tp_size)
    else:
        c.n, c.bonus = accept.simulated(logits, c.key_fn, simulate_accept_length, c.drafts.shape[1], c.sb, c.greedy,
                                        sort=c.bucket.sort, limit=grammar_limit(c, allowed_only=True),
                                        tp=c.target.tp_size)
    c.kept = c.drafts
    c.caches = verify.commit(c.caches, c.scratch["out"].gdn_scratch, c.slots, jnp.where(c.valid, c.n, -1),
                             track=snapshot_track(c), tp=c.target.mixer_tp_size)


def snapshot_track(c: SpecStep, path=None):
    """Hybrid prefix cache: (node, row) `[B]` for `verify.commit`, the accepted-path node whose
    state covers exactly `track_at` tokens when this step's accepted run passes that length, and
    the snapshot row it goes to (node -1: not this step). Decided here, on the device, because with
    overlap the host does not know how far a request has got; the host learns it with the results.
    path `[B, S + 1]`: a tree's accepted nodes, root first (None: a chain, node index = depth).
    None when the bucket tracks nothing."""
    if "track_at" not in c.x:
        return None
    depth = c.x["track_at"] - c.l0 - 1  # the root (depth 0) covers l0 + 1 tokens
    hit = c.valid & (c.x["track_dst"] >= 0) & (depth >= 0) & (depth <= c.n)
    node = depth if path is None else jnp.take_along_axis(path, jnp.clip(depth, 0, path.shape[1] - 1)[:, None],
                                                           axis=1)[:, 0]
    return jnp.where(hit, node, -1), c.x["track_dst"]


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """A speculative step in parts, for structured output: `draft(params, state, packed) ->
    (buffers, rest, view)` runs the draft phase (`carry`; view `[B, D + N]` int32: the drafts, then
    every node's parent, for the host's grammar walk); `verify(params, buffers, rest, grammar,
    masks) -> (state, out)` applies the host's decisions (`apply_grammar`) and runs the rest.

    Pipelined (`Bucket.grammar_pipeline`): `forward(params, buffers, rest, grammar) -> (buffers,
    rest)` replaces drafts by forced runs (`replace_drafts`) and runs the target's forward in
    between; `verify` then masks, accepts and lets the drafter catch up. Given no replacements the
    forward needs nothing from the host, so the host may queue it right behind the draft part and
    walk the grammar while it runs (`jspec.runtime.split_step`)."""

    draft: Callable
    verify: Callable
    forward: Callable | None = None


def compose(start, phases: list[Phase], rows: SpecRows, *, split_after: str = "draft"):
    """The engine's step: start, every phase in order, finish (output rows laid out as `rows`).
    A bucket with `grammar_split` gets the `SplitStep` of the same phases, its first part ending
    with the phase named split_after (the drafts; a plain step's target forward)."""
    if start.bucket.grammar_split:
        return _split(start, phases, rows, split_after)

    def step(params, state: DeviceState, packed, vocab_mask=None):
        c = start(params, state, packed, vocab_mask)
        for _, phase in phases:
            phase(c)
        return finish(c, rows)

    return step


def _split(start, phases: list[Phase], rows: SpecRows, split_after: str) -> SplitStep:
    names = [name for name, _ in phases]
    assert names[0] == "draft" and split_after in names, names
    cut = names.index(split_after) + 1
    # Pipelined: the phases up to the target's forward run as a middle part of their own.
    mid = names.index("verify") + 1 if start.bucket.grammar_pipeline and split_after == "draft" else cut

    def draft(params, state: DeviceState, packed):
        c = start(params, state, packed)
        for _, phase in phases[:cut]:
            phase(c)
        parents = c.scratch.get("parents")
        if parents is None:  # a chain: node j's parent is j - 1
            parents = verify.chain_parents(*c.drafts.shape[:1], c.drafts.shape[1] + 1)
        return *carry(c), jnp.concatenate([c.drafts, parents], axis=1).astype(jnp.int32)

    def forward(params, buffers: dict, rest: dict, grammar):
        c = start.resume(params, buffers, rest)
        replace_drafts(c, grammar)
        for _, phase in phases[cut:mid]:
            phase(c)
        return carry(c)

    def verify_(params, buffers: dict, rest: dict, grammar, masks):
        c = start.resume(params, buffers, rest)
        apply_grammar(c, grammar, masks, replace=mid == cut)
        for _, phase in phases[mid:]:
            phase(c)
        return finish(c, rows)

    return SplitStep(draft=draft, verify=verify_, forward=forward if mid > cut else None)
