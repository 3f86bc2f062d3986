"""A grammar engine's decode step in two compiled parts (`Bucket.grammar_split`), so that the host
work a constrained row needs overlaps the device.

- Speculative (`jspec.speculative.step_common.SplitStep`): the draft part runs first; the host
  reads the drafts, walks each constrained row's grammar along them
  (`jspec.runtime.grammar.draft_inputs`) and launches the rest with its decisions and masks. The
  parts hand over one carry of device arrays (`jspec.speculative.step_common.carry`). With overlap
  the step is pipelined (`Bucket.grammar_pipeline`): the target's forward over the drafts is a
  part of its own, queued right behind the draft part, so the host walks the grammar while it runs
  and what it launches afterwards (masking, acceptance, the drafter's catch-up) is small: launching
  a whole step costs the host milliseconds (bench/README.md, "Structured output"). That launch
  itself runs on a worker thread (`queue_forward`; JAX releases the GIL while it launches), so the
  host reads the previous step and walks the grammar while the forward's graph is updated and
  launched rather than after. On GPUs the forward part is two loaded copies launched in turn
  (`part_copies`), so that neither copy's graph needs that update. Without overlap the forward
  waits for the walk, which may replace a row's drafts by the grammar's forced run.
- Plain decode (`jspec.runtime.step.SplitSample`): the forward runs first, launched on the same
  worker thread (`queue_first`), so the host reads the previous step and fills the masks while the
  forward's graph is updated and launched; the sampling half takes the masks
  (`jspec.runtime.grammar.step_inputs`). A speculative engine's plain step
  (`jspec.speculative.plain_step`) splits as a `SplitStep` with no drafts, after its target
  forward, which it launches itself (the host walks each constrained row's root only).

With overlap, the loop launches the first part before it reads the previous step, whose tokens
the grammars must consume before they can answer (`ModelRunner.dispatch`'s `between`), so the
device computes while the host reads results and fills masks. The device state's buffers are
donated from one part to the next; so is the rest of a speculative step's carry where
`static_carry` keeps it in static buffers (`compile_options.uses_static_carry`), so that the
parts' captured graphs need no re-recording between launches.
Each part is compiled on the arrays it reads (`slim_part`): what a part only passes through
(the target's pools in the draft part) stays with the host, which hands it to the next part.

A batch without constrained rows runs the bucket's fused step instead (compiled beside the parts,
the same step without grammar inputs): two launches and the carry between them cost a small batch
a visible share of its step (bench/README.md, "Structured output"), and a grammar engine mostly
serves unconstrained requests.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec.runtime import grammar, part_copies, slim_part, static_carry
from jspec.runtime.step import SplitSample
from jspec.runtime.step_inputs import Bucket
from jspec.sharding import TP


_launcher: ThreadPoolExecutor | None = None
_launcher_lock = threading.Lock()


def launcher() -> ThreadPoolExecutor:
    """The process's one thread that launches split steps' target forwards: one, so that launches
    reach the device's stream in the order they were queued."""
    global _launcher
    with _launcher_lock:
        if _launcher is None:
            _launcher = ThreadPoolExecutor(1, thread_name_prefix="jspec-launch")
        return _launcher


def _launch(guard: str | None, part, *args):
    """Run `part` on the launcher thread under the loop's `jax.transfer_guard` level (a setting of
    each thread: the loop's does not reach this one)."""
    if guard is None:
        return part(*args)
    with jax.transfer_guard(guard):
        return part(*args)


class SplitExecutable:
    """The compiled parts of one bucket's split step (first, [forward,] second) and its fused twin."""

    def __init__(self, parts: list, bucket: Bucket, sharding, *, plain: bool, guard: str | None = None,
                 arenas: static_carry.ArenaKeeper | None = None, copies: dict | None = None):
        """parts: as `lower` returns them, compiled (a draft part that takes a fourth argument was
        lowered with `static=True`: the carry in an arena, kept by `arenas` between steps, shared
        by the runner's executables so that one arena lives at a time); plain: a plain
        engine's step (a SplitSample: the carry is the state and the logits); else a speculative
        engine's (`step_common.SplitStep`, its plain steps included); guard: the loop's transfer
        guard level, which launches on the launcher thread run under too; copies: {"first" |
        "forward" | "second": a second loaded copy of that part} (`part_copies`), each launched in
        turn with the part so that neither copy's graph is re-recorded before each launch
        (`compile_options.copied_parts`)."""
        self.first, *forward, self.second, self.fused = parts
        self.forward = forward[0] if forward else None
        for name, copy in (copies or {}).items():
            setattr(self, name, part_copies.Alternating(getattr(self, name), copy))
        self.bucket, self.sharding = bucket, sharding
        self.plain, self.guard = plain, guard
        self._replace = False  # pipelined: the next step's forward waits for the walk (a forced run)
        self._no_decisions = None
        # The arena's buffers as the draft part takes them (its fourth argument), and what fills a
        # new one on the device.
        args = self.first.args_info[0]
        self.static = not plain and len(args) == 4
        self._zeros = static_carry.compile_zeros(args[3], sharding) if self.static else None
        self._shapes = static_carry.arena_shapes(args[3]) if self.static else None
        self._arenas = (arenas or static_carry.ArenaKeeper()) if self.static else None

    def _take_arena(self) -> dict:
        """The arena for the next draft part (which donates it): the last step's where it has this
        bucket's shapes (the same width), or a new zeroed one (the first time, after a step of
        another width, or after a step that failed while a part held it)."""
        return self._arenas.take(self._shapes, self._zeros)

    def begin(self, params, state, packed):
        """Launch the first part (it needs nothing from the host) -> its carry (a plain step's: a
        future of it, launched on the launcher thread); a pipelined step also queues its forward
        now, unless the last walk found a forced run (`_replace`)."""
        if self.plain:
            return self.queue_first(params, state, packed)
        carry = self.first(params, state, packed, *([self._take_arena()] if self.static else []))
        buffers, rest, view = carry
        # The drafts' copy to the host is asked for before the forward is queued, so that it is not
        # queued behind the forward's launch: the walk can start as soon as the draft part ends.
        view.copy_to_host_async()
        if self.forward is None or self._replace:
            return carry
        return self.queue_forward(params, buffers, rest, self._walkable()), None, view

    def _walkable(self):
        """Decisions that replace nothing and leave every node walkable, kept on the device."""
        if self._no_decisions is None:
            self._no_decisions = jax.device_put(np.zeros((self.bucket.grammar_size,), np.int32), self.sharding)
        return self._no_decisions

    def queue_first(self, params, state, packed) -> Future:
        """Launch a plain step's forward on the launcher thread -> a future of its (state, logits)."""
        return launcher().submit(_launch, self.guard, self.first, params, state, packed)

    def queue_forward(self, params, buffers, rest, decisions) -> Future:
        """Launch the forward part on the launcher thread -> a future of its (buffers, rest)."""
        return launcher().submit(_launch, self.guard, self.forward, params, buffers, rest, decisions)

    def complete(self, params, packed, carry, plan):
        """Fill the plan's grammar inputs now (the grammars have consumed every earlier token) and
        launch the rest -> (state, out)."""
        b = self.bucket
        if self.plain:
            masks = self._put(grammar.step_inputs(plan, b))  # while the forward may still be launching
            state, logits = carry.result()
            return self.second(params, state, packed, logits, masks)
        buffers, rest, view = carry
        queued = isinstance(buffers, Future)  # its forward was launched on the drafts already
        # Named in profiler traces: the host's wait for the drafts, then its walk over them.
        with jax.profiler.TraceAnnotation("jspec.wait_drafts"):
            view = jax.device_get(view)
        with jax.profiler.TraceAnnotation("jspec.grammar_walk"):
            decisions, masks, forced = grammar.draft_inputs(plan, b, view, replace=not queued)
        decisions = jax.device_put(decisions, self.sharding)
        if self.forward is not None:
            # A forced run seen now is likely still being followed next step: that step's forward
            # then waits for the walk and verifies the run (accepted whole) instead of the drafts.
            self._replace = forced
            # The forward's launch finishes (or, after a forced run, starts) only now: the second
            # part consumes its outputs and must reach the stream after it.
            buffers, rest = (buffers if queued else self.queue_forward(params, buffers, rest, decisions)).result()
        if self.static:  # the verify part only reads the arena: the next draft part writes it again
            self._arenas.keep(self._shapes, rest)
        return self.second(params, buffers, rest, decisions, self._put(masks))

    def _put(self, masks):
        """Masks on the device; all allowed where every constrained row finished meanwhile."""
        if masks is None:
            b = self.bucket
            masks = np.full((b.batch_size, b.grammar_nodes, b.mask_words), -1, np.int32)
        return jax.device_put(masks, self.sharding)

    def warm_up(self, params, state, packed):
        """Run every part on `packed` (padding rows: start-up), every node walkable and every
        token allowed -> (state, out): as a constrained step would, without a plan to walk; the
        whole step once per copy of a part run as two (`part_copies`), so that each copy records
        its graph now, in launch order."""
        parts = (self.first, self.forward, self.second)
        for _ in range(max(len(getattr(p, "copies", ())) or 1 for p in parts if p is not None)):
            state, out = self._run_once(params, state, packed)
        return state, out

    def _run_once(self, params, state, packed):
        masks = self._put(None)
        if self.plain:
            state, logits = self.first(params, state, packed)
            return self.second(params, state, packed, logits, masks)
        buffers, rest, _ = self.first(params, state, packed, *([self._take_arena()] if self.static else []))
        decisions = self._walkable()
        if self.forward is not None:
            buffers, rest = self.forward(params, buffers, rest, decisions)
        if self.static:
            self._arenas.keep(self._shapes, rest)
        return self.second(params, buffers, rest, decisions, masks)

    def __call__(self, params, state, packed, plan=None):
        """(state, out) of the step; plan None (start-up timing) or without constrained rows: the fused step."""
        if plan is None or not grammar.constrained(plan):
            return self.fused(params, state, packed)
        return self.complete(params, packed, self.begin(params, state, packed), plan)


def grammar_fields(words: int, drafting, speculate: bool, steps: int, decode: bool = True, *,
                   pipeline: bool = False) -> dict:
    """A bucket's structured-output fields (words: mask words per token bitmask, 0 without a
    grammar backend): a speculative decode bucket verifies `drafting.grammar_nodes` nodes and runs
    split (pipelined when asked); one that samples one token per row takes one mask, and a decode
    step of those runs split as well (the forward, then sampling with the masks, so the masks are
    filled while the forward runs); prompt chunks take their masks whole."""
    if not words:
        return {}
    if drafting is None or not speculate:
        return dict(grammar_nodes=1, mask_words=words, grammar_split=decode)
    nodes, depth = drafting.grammar_nodes(steps)
    return dict(grammar_nodes=nodes, grammar_depth=depth, mask_words=words, grammar_split=True,
                grammar_pipeline=pipeline)


def without_grammar(bucket: Bucket) -> Bucket:
    """The bucket's fused twin: the same step with no grammar inputs."""
    return dataclasses.replace(bucket, grammar_nodes=0, mask_words=0, grammar_split=False, grammar_depth=0,
                               grammar_pipeline=False)


def lower(split, fused, bucket: Bucket, params, state, packed, *, out_shardings, sharding, tp: int = 1,
          static: bool = False, floors: ArenaFloors | None = None):
    """(lowered first part, [lowered forward part: a pipelined step,] lowered second part, lowered
    fused step) of a split step and its fused twin's step function against abstract arguments.
    The carry keeps each array's place: the state's buffers as the device state holds them (a split
    target's pools split), a plain step's logits split by vocabulary as the forward leaves them
    (when the vocabulary divides by tp), everything else replicated: small for a speculative step's
    drafts; a pipelined step's forward and a speculative engine's plain step also carry the target
    forward's output, which a split target then gathers between the parts (correct, a cost only at
    tp > 1). static: a speculative step's carry goes through the arena of `static_carry` (its last
    argument in every part; the draft and forward parts donate it), laid out by `floors` to hold
    the width's full chain's carry too."""
    masks = jax.ShapeDtypeStruct((bucket.batch_size, bucket.grammar_nodes, bucket.mask_words), jnp.int32,
                                 sharding=sharding)
    lowered_fused = jax.jit(fused, donate_argnums=(1,), out_shardings=out_shardings).lower(params, state, packed)
    state_sh = out_shardings[0]
    if isinstance(split, SplitSample):
        _, logits = jax.eval_shape(split.forward, params, state, packed)
        vocab = NamedSharding(sharding.mesh, P(None, TP)) if logits.shape[-1] % tp == 0 else sharding
        logits_in = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=vocab)
        return (_part(split.forward, (1,), (state_sh, vocab), params, state, packed),
                _part(split.sample, (1,), out_shardings, params, state, packed, logits_in, masks), lowered_fused)
    buffers, rest, view = jax.eval_shape(split.draft, params, state, packed)
    pools = ("caches", "draft_caches", "spec_state")  # the buffers travel as the device state holds them
    buffer_sh = {k: getattr(state_sh, k) if k in pools else dataclasses.replace(state_sh, **{p: None for p in pools})
                 for k in buffers}
    place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731

    def placed(buffers, rest):
        rest_sh = jax.tree.map(lambda _: sharding, rest)
        return rest_sh, jax.tree.map(place, buffers, buffer_sh), jax.tree.map(place, rest, rest_sh)

    rest_sh, buffers_in, rest_in = placed(buffers, rest)
    decisions = jax.ShapeDtypeStruct((bucket.grammar_size,), jnp.int32, sharding=sharding)
    if static:
        layouts = carry_layouts(split, params, buffers_in, rest_in, decisions)
        floor = None if floors is None else floors.floor(bucket, layouts, params, state, sharding)
        return (*_lower_static(split, layouts, params, state, packed, buffers_in, decisions, masks, buffer_sh=buffer_sh,
                               out_shardings=out_shardings, sharding=sharding, floor=floor), lowered_fused)
    lowered = [_part(split.draft, (1,), (buffer_sh, rest_sh, sharding), params, state, packed)]
    if split.forward is not None:  # pipelined: the target's forward as a part of its own
        buffers, rest = jax.eval_shape(split.forward, params, buffers_in, rest_in, decisions)
        forward_sh, _, _ = placed(buffers, rest)
        lowered.append(_part(split.forward, (1, 2), (buffer_sh, forward_sh), params, buffers_in, rest_in, decisions))
        _, buffers_in, rest_in = placed(buffers, rest)
    return (*lowered, _part(split.verify, (1,), out_shardings, params, buffers_in, rest_in, decisions, masks),
            lowered_fused)


def _part(fn, donate: tuple, out_shardings, *args) -> slim_part.SlimLowered:
    """One part lowered on the arrays it reads and writes only (`slim_part`)."""
    return slim_part.lower(fn, args, donate_argnums=donate, out_shardings=out_shardings)


def carry_layouts(split, params, buffers, rest, decisions) -> list:
    """Where the draft part's carry (rest) sits in the arena, and the forward part's after it."""
    layouts = [static_carry.CarryLayout(rest)]
    if split.forward is not None:
        layouts.append(static_carry.CarryLayout(jax.eval_shape(split.forward, params, buffers, rest, decisions)[1]))
    return layouts


def _sizes(layouts: list) -> dict:
    """Elements per dtype of the arena that layouts need ({dtype name: (elements, dtype)})."""
    return {name: (x.shape[0], np.dtype(x.dtype)) for name, x in static_carry.abstract_arena(layouts, None).items()}


class ArenaFloors:
    """The floor of each shorter chain's arena (`lower`): its width's full chain's carry sizes,
    remembered from the full chain's lowering (which the bucket order puts first), or traced from
    shapes once where the full chain was not lowered (loaded from the executable cache)."""

    def __init__(self, drafting, step_fn):
        """step_fn(bucket) -> a bucket's step function."""
        self.drafting, self.step_fn = drafting, step_fn
        self._sizes: dict[Bucket, dict] = {}

    def floor(self, bucket: Bucket, layouts: list, params, state, sharding) -> dict | None:
        """bucket's floor: None for a full chain, whose `carry_layouts` are remembered for its
        shorter chains; the full chain's sizes for a shorter one."""
        if not bucket.draft_steps:
            self._sizes.setdefault(bucket, _sizes(layouts))
            return None
        full = dataclasses.replace(bucket, draft_steps=0, **grammar_fields(
            bucket.mask_words, self.drafting, True, 0, pipeline=bucket.grammar_pipeline))
        if full not in self._sizes:
            split = self.step_fn(full)
            buffers, rest, _ = jax.eval_shape(split.draft, params, state,
                                              jax.ShapeDtypeStruct((full.size,), jnp.int32, sharding=sharding))
            decisions = jax.ShapeDtypeStruct((full.grammar_size,), jnp.int32)
            self._sizes[full] = _sizes(carry_layouts(split, params, buffers, rest, decisions))
        return self._sizes[full]


def _lower_static(split, layouts, params, state, packed, buffers_in, decisions, masks, *, buffer_sh, out_shardings,
                  sharding, floor=None) -> list:
    """`lower`'s speculative parts with the carry in an arena (`static_carry`): draft(params,
    state, packed, arena) -> (buffers, arena, view); [forward(params, buffers, arena, decisions) ->
    (buffers, arena);] verify(params, buffers, arena, decisions, masks) -> (state, out), which only
    reads the arena, so it stays for the next step's draft part to write again. layouts: the
    parts' `carry_layouts`."""
    first = layouts[0]
    arena = static_carry.abstract_arena(layouts, sharding, floor)
    arena_sh = jax.tree.map(lambda _: sharding, arena)

    def draft(params, state, packed, arena):
        buffers, rest, view = split.draft(params, state, packed)
        return buffers, first.write(arena, rest), view

    def forward(params, buffers, arena, decisions):
        buffers, rest = split.forward(params, buffers, first.read(arena), decisions)
        return buffers, layouts[-1].write(arena, rest)

    def verify_(params, buffers, arena, decisions, masks):
        return split.verify(params, buffers, layouts[-1].read(arena), decisions, masks)

    lowered = [_part(draft, (1, 3), (buffer_sh, arena_sh, sharding), params, state, packed, arena)]
    if split.forward is not None:
        lowered.append(_part(forward, (1, 2), (buffer_sh, arena_sh), params, buffers_in, arena, decisions))
    return [*lowered, _part(verify_, (1,), out_shardings, params, buffers_in, arena, decisions, masks)]
