"""`Engine`: the Python entry point, with SGLang's keyword names.

The engine loop runs in a background thread; `generate` validates a request in the caller's thread
(a bad request raises `InvalidRequestError` there and disturbs nobody else), queues it and waits
for it (or streams it). Several threads may call `generate` at once; `abort` works from any thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
import time

import jax
import numpy as np

from jspec.cache.allocator import PageAllocator, SlotAllocator
from jspec.cache.radix_cache import RadixCache
from jspec.cache import memory
from jspec.config import generation_eos_token_ids
from jspec.engine_config import EngineConfig, draft_source
from jspec.errors import EngineShutdownError, InvalidRequestError
from jspec.models.drafters import checkpoint_format, load_drafter
from jspec.models.loader import Model, load_model, load_tokenizer
from jspec.runtime.adaptive import SpecPolicy
from jspec.runtime import outputs
from jspec.runtime.engine_core import EngineCore
from jspec.runtime import gc_heap, startup_runs
from jspec.runtime.grammar import GrammarBackend
from jspec.runtime.executable_cache import enable_compilation_cache, open_executable_cache
from jspec.runtime.model_runner import ModelRunner
from jspec.runtime.request import RequestLimits, make_request, parallel_samples
from jspec.runtime.scheduler import Scheduler
from jspec.sharding import replicated
from jspec.speculative.algorithms import make_drafting

logger = logging.getLogger("jspec")


class Engine:
    def __init__(self, model_path, *, compilation_cache_dir: str | None = None, **kwargs):
        """`model_path`: an HF or orbax checkpoint directory (or a loaded `Model`); keywords: SGLang's
        engine settings (`jspec.engine_config.EngineConfig.create` lists them)."""
        cache_dir = enable_compilation_cache(compilation_cache_dir)
        cfg = self.engine_config = EngineConfig.create(model_path, **kwargs)
        self.spec = cfg.spec
        self.context_length = cfg.context_length
        self.model = (model_path if isinstance(model_path, Model)
                      else load_model(model_path, dtype=cfg.dtype, tp_size=cfg.tp_size,
                                      expert_parallel=cfg.ep_size > 1,
                                      replicate_attention=cfg.replicate_attention))
        self.config = self.model.config
        tokenizer_dir = cfg.tokenizer_path or (self.model.path if isinstance(self.model.path, str) else None)
        self.tokenizer = (None if cfg.skip_tokenizer_init else
                          load_tokenizer(cfg.tokenizer_path) if cfg.tokenizer_path else self.model.tokenizer)
        self.eos_token_ids = set(self.config.eos_token_ids)
        if not isinstance(model_path, Model):
            self.eos_token_ids |= generation_eos_token_ids(model_path)
        self.overlap = not cfg.disable_overlap_schedule
        self._seed_counter = itertools.count()

        drafting = None
        # A drafter passed in belongs to the caller; on a split target the engine replicates it
        # over the mesh, and that copy is the engine's own.
        draft_given = self.spec is not None and not isinstance(self.spec.draft_model_path,
                                                               (str, os.PathLike, type(None)))
        if self.spec is not None:
            draft = self._load_draft()
            if draft is not None and self.model.mesh is not None:
                draft = dataclasses.replace(draft, params=jax.device_put(draft.params, replicated(self.model.mesh)))
                draft_given = False
            drafting = make_drafting(self.spec, self.model, draft)
            if self.spec.simulate_accept_length is not None:
                logger.warning("speculative_simulate_accept_length=%s: acceptance is simulated for benchmarking; "
                               "outputs are NOT the target's", self.spec.simulate_accept_length)
        self.draft_model = None if drafting is None else drafting.draft_model
        # Weights the engine frees at shutdown: those it loaded itself. A model or drafter passed in
        # belongs to the caller, who may build the next engine from it.
        models = [(m, given) for m, given in ((self.model, isinstance(model_path, Model)),
                                              (self.draft_model, draft_given)) if m is not None]
        self._given = [m for m, given in models if given]
        self._owned = [m for m, given in models if not given]  # by flag: Model's == compares parameters
        self.runner = ModelRunner(self.model, layout=cfg.layout, decode_batch_sizes=cfg.cuda_graph_bs,
                                  extend_token_sizes=cfg.prefill_token_buckets,
                                  max_extend_requests=cfg.max_extend_requests,
                                  num_top_logprobs=cfg.max_top_logprobs_num, progress=cfg.show_progress,
                                  drafting=drafting, top_k_top_p=not cfg.disable_top_k_top_p, compile=False,
                                  plain_decode=self.spec is not None and (self.spec.adaptive or
                                                                          self.spec.disable_by_batch_size is not None),
                                  shorter_chains=self.spec is not None and self.spec.adaptive,
                                  prefix_pages=cfg.prefix_pages_per_step, grammar=cfg.grammar_backend is not None,
                                  grammar_pipeline=not cfg.disable_overlap_schedule,
                                  transfer_guard=cfg.transfer_guard,
                                  input_logprobs=cfg.enable_input_logprobs,
                                  executables=open_executable_cache(cache_dir, cfg.cache_context()))
        tokenizer_json = None if tokenizer_dir is None else os.path.join(tokenizer_dir, "tokenizer.json")
        self.grammars = GrammarBackend.create(
            cfg.grammar_backend, vocab_size=self.config.vocab_size, eos_token_ids=self.eos_token_ids,
            tokenizer_path=tokenizer_json if tokenizer_json and os.path.exists(tokenizer_json) else None)
        if cfg.layout.num_pages is None:
            cfg = self.engine_config = cfg.with_memory_plan(self._plan_memory())
        self.runner.capture(cfg.layout)
        self.policy = None
        if self.spec is not None:
            self.policy = SpecPolicy(adaptive=self.spec.adaptive, disable_by_batch_size=self.spec.disable_by_batch_size,
                                     max_drafts=drafting.max_accept - 1)
            if self.spec.adaptive:
                self.policy.step_times = startup_runs.time_decode_steps(self.runner)
        layout = cfg.layout
        self.pages = PageAllocator(layout.num_pages, layout.page_size)
        # EAGLE-family draft KV at p depends on token p + 1: such engines key the cache by token pairs.
        # Hybrid targets keep GDN state snapshots in the state pool's rows past the slots.
        self.radix_cache = (RadixCache(self.pages, bigram=self.spec is not None and self.spec.draft_kind == "eagle",
                                       state_slots=layout.snapshot_rows if self.config.is_hybrid else None)
                            if cfg.radix_cache_enabled else None)
        self.slots = SlotAllocator(layout.num_slots)
        self.scheduler = Scheduler(self.pages, self.slots, max_running_requests=cfg.max_running_requests,
                                   chunked_prefill_size=cfg.chunked_prefill_size,
                                   max_extend_requests=cfg.max_extend_requests,
                                   max_decode_requests=cfg.cuda_graph_bs[-1], enable_mixed_chunk=cfg.enable_mixed_chunk,
                                   spec_tokens=0 if drafting is None else drafting.kv_ahead,
                                   spec_max_accept=0 if drafting is None else drafting.max_accept,
                                   prefill_ahead=0 if drafting is None else drafting.prefill_ahead,
                                   radix_cache=self.radix_cache, prefix_pages_per_step=cfg.prefix_pages_per_step,
                                   schedule_policy=cfg.schedule_policy, prefill_first=cfg.prefill_first,
                                   track_interval=cfg.mamba_track_interval)
        self.core = EngineCore(self.runner, self.scheduler, tokenizer=self.tokenizer,
                               eos_token_ids=self.eos_token_ids, overlap=self.overlap, policy=self.policy)
        self.limits = RequestLimits(vocab_size=self.config.vocab_size, context_length=cfg.context_length,
                                    pool_tokens=cfg.pool_tokens, spec_extra=cfg.spec_extra,
                                    max_top_logprobs=cfg.max_top_logprobs_num,
                                    disable_top_k_top_p=cfg.disable_top_k_top_p,
                                    eos_token_ids=tuple(sorted(self.eos_token_ids)),
                                    input_logprobs=cfg.enable_input_logprobs)
        self._frozen = gc_heap.freeze_startup()  # before the loop starts, so no pause scans start-up
        self._wake = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jspec-engine", daemon=True)
        self._thread.start()

    def _plan_memory(self) -> memory.MemoryPlan:
        """Size the KV pool from the device's memory, now that the weights are resident: the
        allocator's bytes in use, the runner's measured workspace and its per-page and fixed bytes."""
        runner, layout, exes = self.runner, self.engine_config.layout, self.runner.executables
        fixed = runner.state_bytes(0)
        # The page count of the last start with the same settings, kept while it fits: the same
        # pool shapes, so the compiled steps load from the caches.
        key = None if exes is None else exes.key(runner.models_key, "pool pages")
        plan = memory.plan_pages(memory.device_memory(), mem_fraction_static=self.engine_config.mem_fraction_static,
                                 page_bytes=runner.state_bytes(1) - fixed, fixed_bytes=fixed,
                                 workspace_bytes=runner.workspace_bytes(), min_pages=layout.min_pages,
                                 page_size=layout.page_size, previous=None if key is None else exes.recall(key))
        if key is not None:
            exes.remember(key, plan.num_pages)
        return plan

    def _load_draft(self):
        """The drafter: a loaded object passes through (benchmarks build random ones); a path is
        read in its published format (NEXTN: the target's own `mtp.*` tensors by default)."""
        path = self.spec.draft_model_path
        if self.spec.draft_kind == "ngram":
            return None
        if path is not None and not isinstance(path, (str, os.PathLike)):
            return path
        if self.spec.draft_kind == "model":
            return load_model(path, dtype=self.engine_config.dtype)
        kind, path = draft_source(self.spec, self.model.path)
        return load_drafter(kind or checkpoint_format(path), str(path), self.model, self.model.dtype)

    # ------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.core.has_work():
                    self._wake.wait(timeout=0.5)
                if self._stopped:
                    return
            try:
                if self.engine_config.transfer_guard is None:
                    self.core.step()
                else:  # e.g. "disallow": any implicit host<->device transfer in the loop raises
                    with jax.transfer_guard(self.engine_config.transfer_guard):
                        self.core.step()
            except Exception as e:  # noqa: BLE001 - keep serving: fail these requests, not the engine
                self._error = e
                self.core.fail_all(f"engine step failed: {type(e).__name__}: {e}")

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # ------------------------------------------------------------------------------ requests
    def _next_seed(self) -> int:  # drawn from the engine's random_seed, one per unseeded request
        return (self.engine_config.random_seed * 1_000_003 + next(self._seed_counter)) % 2**31

    def _make_request(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, stream, rid,
                      logprob_start_len=-1):
        return make_request(self.limits, self.tokenizer, prompt=prompt, input_ids=input_ids,
                            sampling_params=sampling_params, return_logprob=return_logprob,
                            top_logprobs_num=top_logprobs_num, stream=stream, rid=rid, next_seed=self._next_seed,
                            grammars=self.grammars, logprob_start_len=logprob_start_len)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 top_logprobs_num=0, stream=False, rid=None, logprob_start_len=-1):
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list of dicts).
        A sampling_params with n > 1 makes n samples of its prompt (a list, n per prompt in order).
        logprob_start_len >= 0 (an engine with enable_input_logprobs): meta_info also holds the
        prompt's input_token_logprobs from that position on.

        With stream=True (single prompt, n = 1) returns an iterator of incremental dicts.
        """
        reqs, batch = self._submit(prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream,
                                   rid, logprob_start_len)
        if stream:
            return outputs.stream(self.core.detok, reqs[0], speculative=self.spec is not None)
        for r in reqs:
            r.done.wait()
        outs = [outputs.result(self.core.detok, r, speculative=self.spec is not None) for r in reqs]
        return outs if batch else outs[0]

    def generate_stream_async(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                              top_logprobs_num=0, rid=None, logprob_start_len=-1, *, detokenize=True):
        """`generate(stream=True)` for asyncio: validates and queues the request now (a bad one
        raises here), and returns an async iterator of the same chunks, read on the running event
        loop; the engine loop wakes that loop directly, with no reader thread per stream. An
        iterator closed before the end aborts its request. detokenize=False: every chunk's text
        is "" (for a caller that decodes the ids itself)."""
        signal = outputs.LoopSignal(asyncio.get_running_loop())
        reqs, _ = self._submit(prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, True, rid,
                               logprob_start_len, signal)
        return outputs.astream(self.core.detok, reqs[0], speculative=self.spec is not None, abort=self.abort,
                               detokenize=detokenize)

    def _submit(self, prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream, rid,
                logprob_start_len, signal=None):
        """Validate and queue the requests of one call: (requests, whether the call is a batch)."""
        if self._stopped:
            raise EngineShutdownError("generate: this engine was shut down; build a new Engine")
        batch = isinstance(prompt, (list, tuple)) or (
            input_ids is not None and len(input_ids) > 0 and isinstance(input_ids[0], (list, tuple, np.ndarray))
        )
        if batch:
            if stream:
                raise InvalidRequestError("stream: streaming supports one prompt at a time")
            items = prompt if prompt is not None else input_ids
            n = len(items)
            sps = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n
            rids = rid if isinstance(rid, (list, tuple)) else [None] * n
            if len(sps) != n or len(rids) != n:
                raise InvalidRequestError("sampling_params: list length differs from the number of prompts")
            reqs = [
                self._make_request(items[i] if prompt is not None else None,
                                   items[i] if prompt is None else None, sps[i], return_logprob,
                                   top_logprobs_num, False, rids[i], logprob_start_len)
                for i in range(n)
            ]
        else:
            reqs = [self._make_request(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                       stream, rid, logprob_start_len)]
        if any(r.sampling.n > 1 for r in reqs):  # SGLang's parallel sampling: n results per prompt, prompt-major
            reqs = [s for r in reqs for s in parallel_samples(r, self._next_seed)]
            batch = True
        if signal is not None:
            reqs[0].stream_queue = signal
        for r in reqs:
            self.core.submit(r)
        self._notify()
        return reqs, batch

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Drop every cached prefix (SGLang's flush_cache): True when done; False while requests
        run or wait (nothing is dropped then) or without a prefix cache."""
        if self._stopped:
            raise EngineShutdownError("flush_cache: this engine was shut down; build a new Engine")
        if self.radix_cache is None:
            return False
        return self.core.request_flush(timeout, wake=self._notify)

    def _cache_info(self) -> dict:
        cache = self.radix_cache
        if cache is None:
            return {"radix_cache": False}
        info = {"radix_cache": True, "cache_hit_rate": cache.hit_rate, "num_cached_pages": cache.num_cached_pages,
                "num_evictable_pages": cache.num_evictable_pages}
        if cache.stateful:
            info.update(num_cached_states=cache.num_cached_states, num_state_snapshots=cache.num_state_slots)
        return info

    def abort(self, rid: str) -> bool:
        ok = self.core.abort(rid)
        self._notify()
        return ok

    def get_server_info(self) -> dict:
        return {
            **self.engine_config.server_args(),
            "num_total_pages": self.pages.num_usable,
            "num_free_pages": self.pages.num_free,
            **self._cache_info(),
            "num_total_slots": self.slots.num_slots - 1,
            "num_free_slots": self.slots.num_free,
            "num_running_requests": len(self.scheduler.running),
            "num_waiting_requests": len(self.scheduler.waiting) + len(self.core.inbox),
            "num_retractions": self.scheduler.num_retractions,
            "num_steps": dict(self.core.num_steps),
            "num_carry_arena_fills": self.runner.arenas.fills,
            "num_generated_tokens": self.core.num_generated,
            "eos_token_ids": sorted(self.eos_token_ids),
            "compile_seconds": self.runner.compile_seconds, "workspace_compile_seconds": self.runner.workspace_seconds,
            "compile_seconds_per_bucket": dict(self.runner.compile_times),
            "lower_seconds_per_bucket": dict(self.runner.lower_times),
            "kernel_lowerings": dict(self.runner.kernel_lowerings),
            "executable_cache": None if self.runner.executables is None else
            {"hits": self.runner.executables.hits, "misses": self.runner.executables.misses},
            **self._spec_info(),
            "memory": self._memory_info(),
            "last_error": None if self._error is None else repr(self._error),
            "jax_version": jax.__version__,
            "device": str(jax.devices()[0].device_kind),
        }

    def _memory_info(self) -> dict:
        """Bytes behind the pool size, on each device (a split array counts its shard): weights,
        pools, and (when sized from the device's memory) the plan's inputs (`memory.MemoryPlan`)."""
        def nbytes(tree) -> int:
            return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
                       if isinstance(x, jax.Array) and not x.is_deleted())

        state = self.runner.state
        kv = 0 if state is None else nbytes([state.caches.kv, None if state.draft_caches is None
                                             else state.draft_caches.kv])
        info = dict(weights_bytes=nbytes(self.model.params),
                    draft_weights_bytes=0 if self.draft_model is None else nbytes(self.draft_model.params),
                    kv_pool_bytes=kv, state_pool_bytes=nbytes(state) - kv)
        plan = self.engine_config.memory_plan
        if plan is not None:
            info.update(bytes_limit=plan.bytes_limit, mem_fraction_static=plan.mem_fraction_static,
                        resident_bytes=plan.resident_bytes, workspace_bytes=plan.workspace_bytes)
        return info

    def _spec_info(self) -> dict:
        if self.spec is None:
            return {}
        hist = dict(sorted(self.core.accept_histogram.items()))
        steps = sum(hist.values())
        return {
            "speculative_algorithm": self.spec.algorithm,
            "speculative_num_steps": self.spec.num_steps,
            "speculative_eagle_topk": self.spec.topk,
            "speculative_num_draft_tokens": self.spec.num_draft_tokens,
            "avg_spec_accept_length": (sum(k * v for k, v in hist.items()) / steps) if steps else None,
            "spec_accept_length_histogram": hist,
            "speculative_simulate_accept_length": self.spec.simulate_accept_length,
            "speculative_policy": self.policy.info(),
        }

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no request is queued, running or in flight (tests, benchmarks)."""
        end = time.time() + timeout
        while time.time() < end:
            if not self.core.has_work():
                return True
            time.sleep(0.002)
        return False

    def shutdown(self) -> None:
        """Abort what is running, stop the loop and free every device buffer the engine owns (KV and
        state pools, sampler buffers, in-flight outputs, the weights it loaded), so the next engine
        in this process sizes its pool from the whole device. Later calls raise `EngineShutdownError`."""
        if self._stopped:
            return
        for rid in list(self.core.requests):
            self.core.abort(rid, "engine shut down")
        self._notify()
        self.wait_idle(timeout=30.0)
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        self._thread.join(timeout=30.0)
        self.core.release()
        self.runner.release()
        keep = {id(x) for m in self._given for x in jax.tree.leaves(m.params)}
        for m in self._owned:
            for leaf in jax.tree.leaves(m.params):
                if isinstance(leaf, jax.Array) and id(leaf) not in keep and not leaf.is_deleted():
                    leaf.delete()
        self._owned, self._given = [], []
        if self._frozen:
            gc_heap.unfreeze()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
