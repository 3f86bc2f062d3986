"""Owns the device: parameters, the device state, one compiled executable per bucket.

All buckets are compiled ahead of time at start-up ("capture"); afterwards a step only ever calls
a compiled executable, so a shape outside the buckets is an error, never a silent recompilation.
Which buckets an engine has: `bucket_set.step_buckets`. A speculative engine's DECODE buckets run
its algorithm's speculative step (`Drafting`).

Everything lives on one mesh (`jspec.sharding`; one device unless the target is split): the
target's parameters as loaded, its pools split with them (`pool_shardings`), everything else (drafter,
page table, sampler buffers, packed inputs, outputs) replicated. A step is one program; XLA inserts
the collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jspec.cache.pool import PoolLayout, allocate_caches, pool_shardings
from jspec.models import dispatch
from jspec.models.batch import ForwardMode
from jspec.runtime import compile_options, grammar, part_copies, sampler, split_step, startup_runs, static_carry
from jspec.runtime.bucket_set import sampler_twins, step_buckets
from jspec.runtime.executable_cache import (ExecutableCache, abstract_signature, models_signature, stores_served,
                                            xla_cache_hits)
from jspec.runtime.grammar import mask_words, token_words
from jspec.runtime.scheduler import StepPlan
from jspec.runtime.split_step import SplitExecutable
from jspec.runtime.step import Drafting, make_step, with_flat_params
from jspec.runtime.step_inputs import MAX_LOGIT_BIAS, Bucket, DeviceState, pack
from jspec.sharding import make_mesh
from pallas_kernels import lowering_cache, mlir_dialects


@dataclasses.dataclass
class StepHandle:
    plan: StepPlan
    bucket: Bucket
    out: jax.Array  # int32 rows, copying to the host asynchronously
    dispatch_time: float


def _seed_slot(state: DeviceState, slot, words) -> DeviceState:
    counts, mask = sampler.seed_slot(state.output_counts, state.prompt_mask, slot, words)
    return dataclasses.replace(state, output_counts=counts, prompt_mask=mask)


class ModelRunner:
    def __init__(self, model, *, layout: PoolLayout, decode_batch_sizes: list[int], extend_token_sizes: list[int],
                 max_extend_requests: int, num_top_logprobs: int = 20, progress: bool = True,
                 drafting: Drafting | None = None, top_k_top_p: bool = True, compile: bool = True,
                 plain_decode: bool = False, shorter_chains: bool = False, prefix_pages: int = 0,
                 grammar: bool = False, grammar_pipeline: bool = False, input_logprobs: bool = False,
                 executables: ExecutableCache | None = None, transfer_guard: str | None = None):
        """The bucket settings (decode_batch_sizes ... input_logprobs): see `bucket_set.step_buckets`;
        executables: compiled steps are loaded from / stored to this cache (warm starts);
        transfer_guard: the loop's `jax.transfer_guard` level, for the split steps' launches on
        their own thread."""
        self.model = model
        self.drafting = drafting
        self.transfer_guard = transfer_guard
        self.page_size = layout.page_size
        self.pages_per_seq = layout.pages_per_seq
        self.num_top = num_top_logprobs
        self.spec_rows = None if drafting is None else drafting.rows(num_top_logprobs)  # decode output layout
        self.buckets: list[Bucket] = step_buckets(
            model.config.vocab_size, layout, drafting, decode_batch_sizes=decode_batch_sizes,
            extend_token_sizes=extend_token_sizes, max_extend_requests=max_extend_requests, top_k_top_p=top_k_top_p,
            plain_decode=plain_decode, shorter_chains=shorter_chains, prefix_pages=prefix_pages, grammar=grammar,
            grammar_pipeline=grammar_pipeline, input_logprobs=input_logprobs)
        self.layout = layout
        self.mesh = model.mesh if model.mesh is not None else make_mesh(1)
        self._replicated = NamedSharding(self.mesh, P())
        draft_model = None if drafting is None else drafting.draft_model
        params = model.params if draft_model is None else (model.params, draft_model.params)
        leaves, self._params_def = jax.tree_util.tree_flatten(params)
        self.params = tuple(leaves)  # what every step takes (`step.with_flat_params`)
        self.compiled: dict[Bucket, object] = {}
        self._seed = None  # prefix cache: sampler.seed_slot, compiled (ScheduledReq.seed_prompt)
        self._seeds = prefix_pages > 0
        self._open_masks: dict[Bucket, jax.Array] = {}  # grammar buckets: the all-allowed mask, on the device
        self.arenas = static_carry.ArenaKeeper()  # split steps' carry: one arena at a time
        self._floors = split_step.ArenaFloors(drafting, self.step_fn)  # shorter chains' arenas: as large as their full chain's
        self.compile_seconds = 0.0
        self.workspace_seconds = 0.0  # the memory plan's compiles (`workspace_bytes`)
        self.compile_times: dict[str, float] = {}  # bucket label -> seconds its compile took
        self.lower_times: dict[str, float] = {}  # bucket label -> seconds tracing + lowering took (serial)
        # Kernels repeat across buckets (sampler twins, the memory plan's compiles): each distinct
        # one is lowered to Triton once (`lowering_cache`); the counters of the last compile.
        self.kernel_lowerings: dict[str, int] = {}
        lowering_cache.install()
        mlir_dialects.install()  # and its operations do not search for a dialect module each
        self.executables = executables
        self._lower_lock = threading.Lock()  # tracing sets the module-wide mesh (dispatch.tensor_parallel)
        self.state: DeviceState | None = None
        self._progress = progress
        if compile:
            self.capture(layout)

    def capture(self, layout: PoolLayout) -> None:
        """Allocate the device state for `layout`, compile every bucket ("graph capture") and, where
        `startup_runs.warms_up`, run each once. An engine whose pool is sized from the device's
        memory builds the runner with compile=False, measures (`state_bytes`, `workspace_bytes`),
        then captures."""
        self.layout = layout
        shapes = jax.eval_shape(lambda: self.allocate_state(layout))
        self.state = jax.jit(lambda: self.allocate_state(layout), out_shardings=self.state_shardings(shapes))()
        self._compile_all(self._progress)
        if startup_runs.warms_up(self.mesh.devices.flat[0].platform):
            startup_runs.warm_up(self)

    def allocate_state(self, layout: PoolLayout) -> DeviceState:
        """Zeroed device state for a pool layout: the KV and GDN pools of the target (and the
        drafter), the page table, the sampler's per-slot buffers and the drafter's state."""
        cfg, model = self.model.config, self.model
        draft_model = None if self.drafting is None else self.drafting.draft_model
        pools = dict(num_pages=layout.num_pages, page_size=layout.page_size,
                     num_state_slots=layout.num_slots + layout.num_snapshots)
        num_slots = layout.num_slots
        return DeviceState(
            caches=allocate_caches(cfg, dtype=model.dtype, tp_size=model.mixer_tp_size, **pools),
            req_to_page=jnp.zeros((num_slots, layout.pages_per_seq), jnp.int32),
            last_token=jnp.zeros((num_slots,), jnp.int32),
            output_counts=jnp.zeros((num_slots, cfg.vocab_size), jnp.int32),
            prompt_mask=jnp.zeros((num_slots, cfg.vocab_size), bool),
            logit_bias_ids=jnp.full((num_slots, MAX_LOGIT_BIAS), -1, jnp.int32),
            logit_bias_values=jnp.zeros((num_slots, MAX_LOGIT_BIAS), jnp.float32),
            draft_caches=None if draft_model is None else allocate_caches(draft_model.config, dtype=draft_model.dtype,
                                                                          **pools),
            spec_state=None if self.drafting is None else self.drafting.init_state(layout),
            seq_lens=None if self.drafting is None else jnp.zeros((num_slots,), jnp.int32),
        )

    def state_shardings(self, state) -> DeviceState:
        """NamedShardings of a (possibly abstract) device state: the target's pools split as the
        target is, everything else replicated."""
        shardings = jax.tree.map(lambda _: self._replicated, state)
        return dataclasses.replace(shardings, caches=pool_shardings(state.caches, self.mesh, self.model.mixer_tp_size))

    def _abstract_state(self, layout: PoolLayout) -> DeviceState:
        shapes = jax.eval_shape(lambda: self.allocate_state(layout))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                            self.state_shardings(shapes))

    def state_bytes(self, num_pages: int) -> int:
        """Bytes of the state with num_pages pages on one device (its shard of split pools),
        computed from shapes, nothing allocated."""
        state = self._abstract_state(dataclasses.replace(self.layout, num_pages=num_pages))
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(state))

    def workspace_bytes(self) -> int:
        """The largest temporary buffer set of the compiled steps, measured by compiling the largest
        prompt and decode buckets against a pool of `layout.min_pages` (the workspace does not grow
        with the pool: the pools are donated arguments, updated in place), plus a split step's
        carry arena."""
        state = self._abstract_state(dataclasses.replace(self.layout, num_pages=self.layout.min_pages))
        largest = {}
        for b in self.buckets:
            if b.mode not in largest or (b.num_tokens, b.sort) > (largest[b.mode].num_tokens, largest[b.mode].sort):
                largest[b.mode] = b
        def temp_bytes(bucket: Bucket) -> int:
            parts = self._compiled_parts(bucket, state)
            stats = [part.memory_analysis() for part in parts]
            if None in stats and self.executables is not None:  # a loaded executable that cannot tell
                stats = [part.memory_analysis() for part in self._compiled_parts(bucket, state, cached=False)]
            static = compile_options.uses_static_carry(bucket, self.drafting)  # one arena lives at a time
            arena = static_carry.arena_bytes(parts[0].args_info[0][3]) if static else 0
            return max([0] + [int(st.temp_size_in_bytes) for st in stats if st is not None]) + arena
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, len(largest))) as pool:  # the compiles run side by side
            most = max([0, *pool.map(temp_bytes, largest.values())])
        self.workspace_seconds = time.perf_counter() - t0
        return most

    def release(self) -> None:
        """Free the device state now (not when the last reference goes): the pools, the page table,
        the sampler buffers and the drafter's state. Parameters belong to the models."""
        if self.state is not None:
            for leaf in jax.tree.leaves(self.state):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()
        self.state = None
        self.params = None
        self.compiled.clear()
        for mask in self._open_masks.values():
            mask.delete()
        self._open_masks.clear()
        self.drafting = None

    @property
    def speculative(self) -> bool:
        return self.drafting is not None

    def step_fn(self, bucket: Bucket):
        """The (not yet jitted) step function of a bucket; it takes `self.params`, the flat tuple."""
        if bucket.mode is ForwardMode.DECODE and self.drafting is not None:
            fn = self.drafting.make_decode_step(self.model.graphdef, bucket, page_size=self.page_size,
                                                num_top_logprobs=self.num_top)
        else:
            fn = make_step(self.model.graphdef, bucket, page_size=self.page_size, num_top_logprobs=self.num_top,
                           drafting=self.drafting)
        return with_flat_params(fn, self._params_def)

    def _lower(self, bucket: Bucket, state):
        """Trace and lower a bucket's step against `state` (arrays or shardings-carrying shapes)."""
        packed = jax.ShapeDtypeStruct((bucket.size,), jnp.int32, sharding=self._replicated)
        mask = [jax.ShapeDtypeStruct(self._mask_shape(bucket), jnp.int32, sharding=self._replicated)
                ] if bucket.grammar_nodes and not bucket.grammar_split else []
        out_shardings = (self.state_shardings(state), self._replicated)
        with self._lower_lock, dispatch.tensor_parallel(self.mesh):
            if bucket.grammar_split:  # two parts (split_step.py)
                return split_step.lower(self.step_fn(bucket), self.step_fn(split_step.without_grammar(bucket)),
                                        bucket, self.params, state, packed, out_shardings=out_shardings,
                                        sharding=self._replicated, tp=self.model.tp_size, floors=self._floors,
                                        static=compile_options.uses_static_carry(bucket, self.drafting))
            return jax.jit(self.step_fn(bucket), donate_argnums=(1,), out_shardings=out_shardings).lower(
                self.params, state, packed, *mask)

    def _run(self, bucket: Bucket, packed, masks=None, plan=None):
        """Launch a bucket's compiled step: (state, out). masks: a one-token step's grammar masks
        (None: all allowed); plan: what a split step's grammar walk reads."""
        exe = self.compiled[bucket]
        if bucket.grammar_split:
            return exe(self.params, self.state, packed, plan)
        return exe(self.params, self.state, packed, *self._mask_args(bucket, masks))

    @staticmethod
    def _mask_shape(bucket: Bucket) -> tuple[int, int, int]:
        return bucket.batch_size, bucket.grammar_nodes, bucket.mask_words

    def _mask_args(self, bucket: Bucket, masks) -> list:
        """The step's grammar input: none for a bucket without one; the plan's masks; or, when no
        row is constrained, an all-allowed mask kept on the device (nothing to transfer)."""
        if not bucket.grammar_nodes:
            return []
        if masks is not None:
            return [jax.device_put(masks, self._replicated)]
        if bucket not in self._open_masks:
            self._open_masks[bucket] = jax.device_put(np.full(self._mask_shape(bucket), -1, np.int32),
                                                      self._replicated)
        return [self._open_masks[bucket]]

    @functools.cached_property
    def models_key(self) -> str:
        drafter = getattr(self.drafting, "draft_model", None)
        return models_signature(self.params, self.mesh, [m for m in (self.model, drafter) if m is not None],
                                self.page_size, self.num_top, type(self.drafting).__name__)

    def _key(self, bucket: Bucket, state) -> str | None:
        """The executable cache's key of a bucket's step against `state` (None: no cache)."""
        return None if self.executables is None else self.executables.key(self.models_key, repr(bucket),
                                                                          abstract_signature(state))

    def _compiled_parts(self, bucket: Bucket, state, lowered=None, cached: bool = True) -> list:
        """A bucket's compiled executable(s) (three for a split step): from the executable cache
        (unless not `cached`), else lowered (unless given), compiled and stored."""
        key = self._key(bucket, state)
        parts = None if key is None or not cached else self.executables.load(key, self.mesh.devices.flat)
        if parts is None:
            lowered = self._lower(bucket, state) if lowered is None else lowered
            served, platform = xla_cache_hits(), self.mesh.devices.flat[0].platform
            parts = [p.compile(compile_options.step_compiler_options(platform, bucket, self.drafting, i,
                                                                     tp=self.model.tp_size) or None)
                     for i, p in enumerate(lowered if isinstance(lowered, tuple) else (lowered,))]
            if key is not None:  # on CPU fresh compiles only: see executable_cache.stores_served
                if xla_cache_hits() == served or stores_served(platform):
                    self.executables.store(key, parts)
                else:
                    self.executables.discard(key)
        return parts

    def _compile_all(self, progress: bool) -> None:
        t0 = time.perf_counter()
        if self._seeds:
            words = jax.ShapeDtypeStruct((mask_words(self.model.config.vocab_size),), jnp.int32,
                                         sharding=self._replicated)
            slot = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
            self._seed = jax.jit(_seed_slot, donate_argnums=(0,), out_shardings=self.state_shardings(self.state)
                                 ).lower(self.state, slot, words).compile()

        def compile_one(b: Bucket, lowered, after=None):
            if after is not None:  # the sampler twin's compile
                after.result()
            t = time.perf_counter()
            parts = self._compiled_parts(b, self.state, lowered)
            exe = parts[0] if not b.grammar_split else SplitExecutable(
                parts, b, self._replicated, plain=self.drafting is None, guard=self.transfer_guard,
                arenas=self.arenas, copies=part_copies.for_split(parts, b, list(self.mesh.devices.flat)))
            return b, exe, time.perf_counter() - t

        # Tracing holds the GIL and runs here, one bucket after another; XLA's compilation releases
        # it, so each bucket compiles on the pool as soon as it is lowered, beside the tracing of
        # the next. Buckets the executable cache holds only load. On a GPU, XLA autotunes each
        # step's matmuls and keeps the results in one cache per process: a bucket with a sampler
        # twin (the same forward) is traced after the others and compiles once its twin has, so
        # it finds its matmuls tuned instead of tuning them again beside the twin. The pool runs
        # tasks in order, so a twin always runs before the bucket waiting for it.
        cached = {b for b in self.buckets if self.executables is not None and self._key(b, self.state) in self.executables}
        todo = [b for b in self.buckets if b not in cached]
        twins = sampler_twins(todo) if compile_options.autotunes_matmuls(self.mesh.devices.flat[0].platform) else {}
        with (tqdm(total=len(self.buckets), desc="compile buckets", disable=not progress, unit="bucket") as bar,
              ThreadPoolExecutor(max_workers=max(1, min(len(self.buckets), os.cpu_count() or 1))) as pool):
            futures = [pool.submit(compile_one, b, None) for b in self.buckets if b in cached]
            started = {}
            for bucket in sorted(todo, key=lambda b: b in twins):  # stable: the twins' order kept
                bar.set_postfix_str(f"tracing {bucket.label}", refresh=False)
                t = time.perf_counter()
                lowered = self._lower(bucket, self.state)
                self.lower_times[bucket.label] = time.perf_counter() - t
                started[bucket] = pool.submit(compile_one, bucket, lowered, started.get(twins.get(bucket)))
            futures += started.values()
            for done in as_completed(futures):
                b, exe, sec = done.result()
                self.compiled[b] = exe
                self.compile_times[b.label] = sec  # seconds of each bucket (a warm start: cache loads)
                bar.set_postfix_str(f"{b.label} {sec:.1f} s", refresh=False)
                bar.update()
        self.compile_seconds = time.perf_counter() - t0
        self.kernel_lowerings = lowering_cache.take()

    def decode_batch_size(self, num_requests: int) -> int:
        """The batch bucket a decode step of num_requests requests is padded to."""
        return min(b.batch_size for b in self.buckets if b.mode is ForwardMode.DECODE and b.batch_size >= num_requests)

    def run_padding(self, bucket: Bucket, every_part: bool = False):
        """Run a bucket's step on padding rows (start-up: `startup_runs`) -> its output; every_part:
        a split step's parts too, not only its fused twin."""
        packed = jax.device_put(pack(StepPlan(bucket.mode, [], []), bucket), self._replicated)
        if every_part and bucket.grammar_split:
            self.state, _ = self.compiled[bucket].warm_up(self.params, self.state, packed)
        self.state, out = self._run(bucket, packed)
        return out

    def bucket_for(self, plan: StepPlan) -> Bucket:
        n_tok, n_req = plan.num_tokens, len(plan.reqs)
        sort = None
        if plan.mode is ForwardMode.DECODE:
            vocab = self.model.config.vocab_size
            sort = any(s.req.sampling.needs_sort(vocab) for s in plan.reqs)
        for b in self.buckets:
            if (b.mode is plan.mode and b.num_tokens >= n_tok and b.batch_size >= n_req
                    and (sort is None or b.sort == sort) and b.speculate == plan.speculate
                    and b.draft_steps == plan.draft_steps and b.input_logprobs == plan.input_logprobs):
                return b
        raise AssertionError(f"no {plan.mode.value} bucket for {n_tok} tokens / {n_req} requests")

    def dispatch(self, plan: StepPlan, between=None) -> StepHandle:
        """Pack, transfer once, launch; returns at once (outputs copy to the host asynchronously).

        between: called once, as early as the step allows, before the host fills the grammar
        inputs of the plan's constrained rows (the loop reads the previous step there, whose
        tokens those grammars must consume first): after the launch when there are none, between
        the parts of a split step, before a one-part step's masks."""
        bucket = self.bucket_for(plan)
        # Named in profiler traces (a no-op otherwise): the host side of a step, which with
        # overlap runs while the device still executes the step before it.
        with jax.profiler.TraceAnnotation(f"jspec.dispatch {bucket.mode.value} B{bucket.batch_size}"):
            for s in plan.reqs:
                if s.seed_prompt:  # its cached prompt tokens into the slot's penalty state
                    words = token_words(s.req.input_ids[:s.start], self.model.config.vocab_size)
                    self.state = self._seed(self.state, *jax.device_put((np.int32(s.req.slot), words),
                                                                       self._replicated))
            packed = jax.device_put(pack(plan, bucket), self._replicated)
            waits = between is not None and bucket.grammar_nodes > 0 and bool(grammar.constrained(plan))
            if waits and bucket.grammar_split:
                exe = self.compiled[bucket]
                carry = exe.begin(self.params, self.state, packed)
                try:
                    with jax.profiler.TraceAnnotation("jspec.between"):  # named in traces: read the last step
                        between()
                finally:  # the state was donated to the first part: finish the step even if reading failed
                    self.state, out = exe.complete(self.params, packed, carry, plan)
            else:
                if waits:
                    between()
                masks = grammar.step_inputs(plan, bucket) if bucket.grammar_nodes and not bucket.grammar_split \
                    else None
                self.state, out = self._run(bucket, packed, masks, plan)
            out.copy_to_host_async()
        handle = StepHandle(plan, bucket, out, time.perf_counter())
        if between is not None and not waits:
            between()
        return handle

    @staticmethod
    def fetch(handle: StepHandle) -> np.ndarray:
        # Explicit, so the loop runs clean under jax.transfer_guard("disallow"); the copy was
        # started at dispatch, so this normally only waits for the step to finish.
        return jax.device_get(handle.out)
