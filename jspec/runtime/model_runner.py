"""Owns the device: parameters, the device state, one compiled executable per bucket.

All buckets are compiled ahead of time at start-up ("capture"); afterwards a step only ever calls
a compiled executable, so a shape outside the buckets is an error, never a silent recompilation.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jspec.models.batch import empty_caches
from jspec.runtime.scheduler import StepPlan
from jspec.runtime.step import DeviceState, make_step
from jspec.runtime.step_inputs import Bucket, pack
from jspec.spec.eagle_step import init_spec_state


@dataclasses.dataclass
class StepHandle:
    plan: StepPlan
    bucket: Bucket
    out: jax.Array  # [B, 2 + 2 n_top] int32, copying to the host asynchronously
    dispatch_time: float


class ModelRunner:
    def __init__(self, model, *, page_size: int, num_pages: int, num_slots: int, pages_per_seq: int,
                 decode_batch_sizes: list[int], extend_token_sizes: list[int], max_extend_requests: int,
                 num_top_logprobs: int = 20, progress: bool = True, draft_model=None, spec=None,
                 top_k_top_p: bool = True):
        self.model = model
        self.draft_model = draft_model
        self.spec = spec
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.num_top = num_top_logprobs
        self.buckets: list[Bucket] = []
        sorts = (False, True) if top_k_top_p else (False,)  # without top-k / top-p, no sort variant
        for b in sorted(set(decode_batch_sizes)):
            if spec is None:
                # Two variants: the host knows whether any request needs top-k / top-p, so the
                # sampler's choice is static and no device-side conditional stalls dispatch.
                for sort in sorts:
                    self.buckets.append(Bucket("decode", b, b, b, sort=sort))
            else:  # a speculative step writes num_draft_tokens positions per request
                for sort in sorts:
                    self.buckets.append(Bucket("spec", b, b, b * (-(-spec.kv_ahead // page_size) + 1), sort=sort))
        self.draft_kind = None if spec is None else spec.draft_kind
        ahead_pages = 0 if spec is None else -(-spec.prefill_ahead // page_size)
        for t in sorted(set(extend_token_sizes)):
            b = min(t, max_extend_requests)
            self.buckets.append(Bucket("extend", t, b, t // page_size + b * (1 + ahead_pages) + 1,
                                       next_ids=self.draft_kind == "eagle"))
        cfg = model.config
        self.state = DeviceState(
            caches=empty_caches(cfg, num_pages=num_pages, page_size=page_size, num_state_slots=num_slots,
                                dtype=model.dtype),
            req_to_page=jnp.zeros((num_slots, pages_per_seq), jnp.int32),
            last_token=jnp.zeros((num_slots,), jnp.int32),
            output_counts=jnp.zeros((num_slots, cfg.vocab_size), jnp.int32),
            prompt_mask=jnp.zeros((num_slots, cfg.vocab_size), bool),
            draft_caches=None if draft_model is None else empty_caches(
                draft_model.config, num_pages=num_pages, page_size=page_size, num_state_slots=num_slots,
                dtype=draft_model.dtype),
            spec_state=self._init_spec_state(num_slots),
            seq_lens=None if spec is None else jnp.zeros((num_slots,), jnp.int32),
        )
        self.params = model.params if draft_model is None else (model.params, draft_model.params)
        self.compiled: dict[Bucket, object] = {}
        self.compile_seconds = 0.0
        self._compile_all(progress)

    def _init_spec_state(self, num_slots: int) -> dict | None:
        """What a drafter carries between steps per slot (see DeviceState.spec_state)."""
        if self.draft_kind == "eagle":
            return init_spec_state(num_slots, self.model.config.hidden_size, self.model.dtype, topk=self.spec.topk)
        if self.draft_kind == "dflash":
            from jspec.spec.dflash_step import init_spec_state as init_block_state

            return init_block_state(num_slots, self.spec.num_steps)
        if self.draft_kind == "ngram":  # the token at every KV position a request can reach
            return {"history": jnp.zeros((num_slots, self.pages_per_seq * self.page_size), jnp.int32)}
        return None

    def _compile_all(self, progress: bool) -> None:
        t0 = time.perf_counter()
        lowered = {}
        for bucket in tqdm(self.buckets, desc="capture (trace buckets)", disable=not progress, unit="bucket"):
            draft_gd = None if self.draft_model is None else self.draft_model.graphdef
            if bucket.mode == "spec":
                from jspec.spec.chain_step import make_chain_spec_step
                from jspec.spec.eagle_step import make_eagle_spec_step

                from jspec.spec.tree_step import make_tree_spec_step

                sp = self.spec
                kw = dict(page_size=self.page_size, num_steps=sp.num_steps,
                          simulate_accept_length=sp.simulate_accept_length)
                if sp.topk > 1:
                    fn = make_tree_spec_step(self.model.graphdef, draft_gd, bucket, topk=sp.topk,
                                             num_draft_tokens=sp.num_draft_tokens, **kw)
                elif self.draft_kind == "dflash":
                    from jspec.spec.dflash_step import make_dflash_spec_step

                    fn = make_dflash_spec_step(self.model.graphdef, draft_gd, bucket, **kw)
                else:
                    if self.draft_kind == "ngram":
                        kw["ngram_windows"] = (sp.ngram_min_window, sp.ngram_max_window)
                    make = make_eagle_spec_step if self.draft_kind == "eagle" else make_chain_spec_step
                    fn = make(self.model.graphdef, draft_gd, bucket, **kw)
            else:
                fn = make_step(self.model.graphdef, bucket, page_size=self.page_size,
                               num_top_logprobs=self.num_top, draft_graphdef=draft_gd, draft_kind=self.draft_kind)
            packed = jax.ShapeDtypeStruct((bucket.size,), jnp.int32)
            lowered[bucket] = jax.jit(fn, donate_argnums=(1,)).lower(self.params, self.state, packed)
        # Tracing holds the GIL; XLA's compilation releases it, so the buckets compile side by side.
        with ThreadPoolExecutor(max_workers=max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
            done = pool.map(lambda b: (b, lowered[b].compile()), list(lowered))
            self.compiled.update(tqdm(done, total=len(lowered), desc="compile buckets", disable=not progress,
                                      unit="bucket"))
        self.compile_seconds = time.perf_counter() - t0

    def bucket_for(self, plan: StepPlan) -> Bucket:
        n_tok, n_req = plan.num_tokens, len(plan.reqs)
        if plan.mode == "decode" and self.spec is not None:
            plan.mode = "spec"
        sort = None
        if plan.mode in ("decode", "spec"):
            vocab = self.model.config.vocab_size
            sort = any(s.req.sampling.needs_sort(vocab) for s in plan.reqs)
        for b in self.buckets:
            if (b.mode == plan.mode and b.num_tokens >= n_tok and b.batch_size >= n_req
                    and (sort is None or b.sort == sort)):
                return b
        raise AssertionError(f"no {plan.mode} bucket for {n_tok} tokens / {n_req} requests")

    def dispatch(self, plan: StepPlan) -> StepHandle:
        """Pack, transfer once, launch; returns at once (outputs copy to the host asynchronously)."""
        bucket = self.bucket_for(plan)
        # Named in profiler traces (a no-op otherwise): the host side of a step, which with
        # overlap runs while the device still executes the step before it.
        with jax.profiler.TraceAnnotation(f"jspec.dispatch {bucket.mode} B{bucket.batch_size}"):
            packed = jax.device_put(pack(plan, bucket))
            self.state, out = self.compiled[bucket](self.params, self.state, packed)
            out.copy_to_host_async()
        return StepHandle(plan, bucket, out, time.perf_counter())

    @staticmethod
    def fetch(handle: StepHandle) -> np.ndarray:
        # Explicit, so the loop runs clean under jax.transfer_guard("disallow"); the copy was
        # started at dispatch, so this normally only waits for the step to finish.
        return jax.device_get(handle.out)
