"""`Engine`: the Python entry point, with SGLang's keyword names.

The engine loop runs in a background thread; `generate` validates a request in the caller's thread
(a bad request raises `InvalidRequestError` there and disturbs nobody else), queues it and waits
for it (or streams it). Several threads may call `generate` at once; `abort` works from any thread.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid

import jax
import numpy as np

from jspec.cache.page_allocator import PageAllocator
from jspec.cache.slot_allocator import SlotAllocator
from jspec.errors import ConfigError, InvalidRequestError, JspecError
from jspec.models.loader import Model, load_model, resolve_dtype
from jspec.runtime.engine_core import EngineCore
from jspec.runtime.model_runner import ModelRunner
from jspec.runtime.request import Request
from jspec.runtime.sampling_params import SamplingParams
from jspec.runtime.scheduler import Scheduler

logger = logging.getLogger("jspec")
DEFAULT_CUDA_GRAPH_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256]
_ENGINE_KEYS = {
    "model_path", "dtype", "page_size", "max_running_requests", "max_total_tokens", "chunked_prefill_size",
    "cuda_graph_bs", "disable_overlap_schedule", "random_seed", "context_length", "mem_fraction_static",
    "prefill_token_buckets", "max_top_logprobs_num", "skip_tokenizer_init", "show_progress",
    "compilation_cache_dir", "enable_mixed_chunk", "transfer_guard", "disable_top_k_top_p",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "speculative_simulate_accept_length",
    "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
}


def _enable_compilation_cache(path: str | None) -> None:
    path = path or os.environ.get("JSPEC_COMPILATION_CACHE", os.path.expanduser("~/.cache/jspec/xla"))
    if path in ("", "none"):
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _device_free_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends have none
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _dflash_block_size(kwargs: dict) -> int | None:
    """The block size a DFLASH drafter was trained with (the default number of draft tokens):
    from a drafter object, or from its config.json; None if there is nothing to read it from."""
    if str(kwargs.get("speculative_algorithm") or "").upper() != "DFLASH":
        return None
    path = kwargs.get("speculative_draft_model_path")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        return getattr(path, "block_size", None)
    file = os.path.join(str(path), "config.json") if path else ""
    if not os.path.isfile(file):
        return None  # the loader reports the missing directory or config
    with open(file) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError:
            return None
    block = (raw.get("dflash_config") or {}).get("block_size", raw.get("block_size"))
    return block if isinstance(block, int) and not isinstance(block, bool) else None


def _draft_kv_per_token(spec, target_cfg) -> int:
    """K and V elements per token of a drafter's own KV pool (0 without one): its attention layers
    x KV heads x head dim, from the drafter object or its config.json (EAGLE-family heads and the
    MTP layer default to one layer shaped like the target's)."""
    if spec is None or spec.draft_kind == "ngram":
        return 0
    path = spec.draft_model_path
    cfg = getattr(path, "config", None)
    if cfg is not None:
        return 2 * len(cfg.attention_layer_ids) * cfg.num_key_value_heads * cfg.head_dim
    raw = {}
    file = os.path.join(str(path), "config.json") if isinstance(path, (str, os.PathLike)) else ""
    if file and os.path.isfile(file):
        with open(file) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError:
                raw = {}
    layers = int(raw.get("num_hidden_layers", 1)) if spec.draft_kind in ("model", "dflash") else 1
    heads = int(raw.get("num_key_value_heads", target_cfg.num_key_value_heads))
    head_dim = int(raw.get("head_dim") or target_cfg.head_dim)
    return 2 * layers * heads * head_dim


class Engine:
    def __init__(self, model_path: str, dtype: str = "bfloat16", page_size: int = 16,
                 max_running_requests: int | None = None, max_total_tokens: int | None = None,
                 chunked_prefill_size: int | None = None, cuda_graph_bs: list[int] | None = None,
                 disable_overlap_schedule: bool = False, random_seed: int = 0, **kwargs):
        unknown = set(kwargs) - _ENGINE_KEYS
        if unknown:
            raise ConfigError(f"unknown Engine argument(s): {', '.join(sorted(unknown))}")
        preloaded = model_path if isinstance(model_path, Model) else None  # benchmarks: random weights
        if preloaded is None:
            if not isinstance(model_path, (str, os.PathLike)) or not os.path.isdir(model_path):
                raise ConfigError(f"model_path={model_path!r} is not a directory")
            if not os.path.exists(os.path.join(model_path, "config.json")):
                raise ConfigError(f"model_path={model_path!r} has no config.json")
            resolve_dtype(dtype)
        if not isinstance(page_size, int) or page_size < 1:
            raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
        on_gpu = jax.default_backend() == "gpu"
        show = kwargs.get("show_progress", True)
        _enable_compilation_cache(kwargs.get("compilation_cache_dir"))

        from jspec.config import load_config

        config = preloaded.config if preloaded is not None else load_config(model_path)
        from jspec.spec.config import check_draft, parse_spec_config

        self.spec = parse_spec_config(kwargs, target_family=config.family, target_is_hybrid=config.is_hybrid,
                                      draft_block_size=_dflash_block_size(kwargs))
        if (self.spec is not None and self.spec.algorithm == "STANDALONE"
                and isinstance(self.spec.draft_model_path, (str, os.PathLike))):
            if not os.path.isdir(str(self.spec.draft_model_path)):
                raise ConfigError(f"speculative_draft_model_path={self.spec.draft_model_path!r} is not a directory")
            check_draft(self.spec, config, load_config(self.spec.draft_model_path))
        if self.spec is not None:
            if kwargs.get("enable_mixed_chunk"):
                raise ConfigError("enable_mixed_chunk with speculative decoding is not implemented yet")
        context = int(kwargs.get("context_length") or config.max_position_embeddings)
        if context < 2:
            raise ConfigError(f"context_length must be >= 2, got {context}")
        self.context_length = context

        # Batch sizes ("CUDA graph" buckets) and the running-request cap.
        if max_running_requests is not None and max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {max_running_requests}")
        cap = max_running_requests or (128 if on_gpu else 16)
        bs = sorted(set(cuda_graph_bs or [b for b in DEFAULT_CUDA_GRAPH_BS if b <= cap] or [cap]))
        if any((not isinstance(b, int)) or b < 1 for b in bs):
            raise ConfigError(f"cuda_graph_bs must be positive ints, got {cuda_graph_bs!r}")
        if bs[-1] < cap:
            bs.append(cap)
        max_running = max_running_requests or bs[-1]
        bs = [b for b in bs if b <= max(max_running, bs[0])]
        if bs[-1] < max_running:
            bs.append(max_running)

        chunk = int(chunked_prefill_size or (8192 if on_gpu else 512))
        if chunk < 1:
            raise ConfigError(f"chunked_prefill_size must be >= 1, got {chunk}")
        buckets = kwargs.get("prefill_token_buckets")
        if buckets is None:
            buckets, t = [], 16
            while t < chunk:
                buckets.append(t)
                t *= 2
            buckets.append(chunk)
        buckets = sorted(set(int(b) for b in buckets if b <= chunk) | {chunk})

        # KV pool size: explicit, or from free device memory, or a CPU default.
        # A speculative step writes num_draft_tokens positions past the request's current length,
        # so rows of the page table cover that much beyond the context length.
        self.spec_extra = 0 if self.spec is None else self.spec.kv_ahead
        if self.spec is not None and not disable_overlap_schedule:
            # Spec v2: a step already in flight for a request that has just finished may still
            # accept up to num_steps + 1 tokens and write ahead of them.
            self.spec_extra += self.spec.num_steps + 1
        pages_per_seq = -(-(context + self.spec_extra) // page_size)
        if max_total_tokens is None:
            free = _device_free_bytes()
            if free is None:
                max_total_tokens = max(4 * context, 8192) if context <= 8192 else context
            else:
                frac = kwargs.get("mem_fraction_static") or 0.85
                per_token = 2 * len(config.attention_layer_ids) * config.num_key_value_heads * config.head_dim
                # A drafter keeps its own KV pool with as many pages as the target's.
                per_token += _draft_kv_per_token(self.spec, config)
                per_token *= np.dtype(resolve_dtype(dtype)).itemsize
                weights = 0  # parameters are not resident yet; estimated from the checkpoint below
                if preloaded is None:
                    for f in os.listdir(model_path):
                        if f.endswith(".safetensors"):
                            weights += os.path.getsize(os.path.join(model_path, f))
                budget = int(free * frac) - weights - (1 << 30)
                max_total_tokens = max(budget // max(per_token, 1), page_size * 2)
        if max_total_tokens < 1:
            raise ConfigError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
        num_pages = -(-int(max_total_tokens) // page_size) + 1  # + the padding sink page
        if (num_pages - 1) * page_size < min(context, 2 * page_size) or (num_pages - 1) < 1:
            raise ConfigError(
                f"max_total_tokens={max_total_tokens} gives a KV pool too small for one request "
                f"({(num_pages - 1) * page_size} tokens)"
            )
        self.pool_tokens = (num_pages - 1) * page_size
        num_slots = max_running + 1  # + the padding sink slot

        self.model = preloaded if preloaded is not None else load_model(model_path, dtype=dtype)
        self.config = self.model.config
        self.tokenizer = None if kwargs.get("skip_tokenizer_init") else self.model.tokenizer
        self.eos_token_ids = set(self.config.eos_token_ids) | (set() if preloaded is not None else self._generation_eos(model_path))
        self.max_top_logprobs = int(kwargs.get("max_top_logprobs_num", 20))
        # Greedy / temperature / min-p only: capture skips every step's sort variant (half the
        # compilation), and a request asking for top-k or top-p is refused.
        self.disable_top_k_top_p = bool(kwargs.get("disable_top_k_top_p", False))
        self.overlap = not disable_overlap_schedule
        self.random_seed = int(random_seed)
        self._seed_counter = itertools.count()

        self.draft_model = None
        if self.spec is not None and self.spec.draft_kind != "ngram":
            self.draft_model = self._load_draft(dtype)
            if self.spec.simulate_accept_length is not None:
                logger.warning("speculative_simulate_accept_length=%s: acceptance is simulated for benchmarking; "
                               "outputs are NOT the target's", self.spec.simulate_accept_length)
        self.pages = PageAllocator(num_pages, page_size)
        self.slots = SlotAllocator(num_slots)
        self.scheduler = Scheduler(self.pages, self.slots, max_running_requests=max_running,
                                   chunked_prefill_size=chunk, max_extend_requests=min(max_running, 64),
                                   max_decode_requests=bs[-1],
                                   enable_mixed_chunk=bool(kwargs.get("enable_mixed_chunk", False)),
                                   spec_tokens=0 if self.spec is None else self.spec.kv_ahead,
                                   spec_max_accept=0 if self.spec is None else self.spec.num_steps + 1,
                                   prefill_ahead=0 if self.spec is None else self.spec.prefill_ahead)
        self.runner = ModelRunner(self.model, page_size=page_size, num_pages=num_pages, num_slots=num_slots,
                                  pages_per_seq=pages_per_seq, decode_batch_sizes=bs,
                                  extend_token_sizes=buckets, max_extend_requests=min(max_running, 64),
                                  num_top_logprobs=self.max_top_logprobs, progress=show,
                                  draft_model=self.draft_model, spec=self.spec,
                                  top_k_top_p=not self.disable_top_k_top_p)
        self.core = EngineCore(self.runner, self.scheduler, tokenizer=self.tokenizer,
                               eos_token_ids=self.eos_token_ids, overlap=self.overlap, spec=self.spec)
        self.server_args = dict(model_path=self.model.path, dtype=str(self.model.dtype), page_size=page_size,
                                max_running_requests=max_running, max_total_tokens=self.pool_tokens,
                                chunked_prefill_size=chunk, cuda_graph_bs=bs, prefill_token_buckets=buckets,
                                disable_overlap_schedule=disable_overlap_schedule, random_seed=random_seed,
                                context_length=context, disable_top_k_top_p=self.disable_top_k_top_p,
                                enable_mixed_chunk=bool(kwargs.get("enable_mixed_chunk", False)))
        self._transfer_guard = kwargs.get("transfer_guard")
        self._wake = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jspec-engine", daemon=True)
        self._thread.start()

    def _load_draft(self, dtype):
        """The drafter: a loaded object passes through (benchmarks build random ones); a path is
        read in its published format (NEXTN: the target's own `mtp.*` tensors by default)."""
        path = self.spec.draft_model_path
        if path is not None and not isinstance(path, (str, os.PathLike)):
            return path
        if self.spec.draft_kind == "model":
            return load_model(path, dtype=dtype)
        from jspec.models.drafters.loader import checkpoint_format, load_drafter

        kind = self.spec.algorithm
        if kind == "NAIVE_EAGLE":
            kind = "NEXTN" if path is None else None
        path = path or self.model.path
        if not os.path.isdir(str(path)):
            raise ConfigError(f"speculative_draft_model_path={path!r} is not a directory")
        return load_drafter(kind or checkpoint_format(path), str(path), self.model, self.model.dtype)

    @staticmethod
    def _generation_eos(path: str) -> set[int]:
        f = os.path.join(path, "generation_config.json")
        if not os.path.exists(f):
            return set()
        with open(f) as fh:
            eos = json.load(fh).get("eos_token_id")
        if eos is None:
            return set()
        return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}

    # ------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.core.has_work():
                    self._wake.wait(timeout=0.5)
                if self._stopped:
                    return
            try:
                if self._transfer_guard is None:
                    self.core.step()
                else:  # e.g. "disallow": any implicit host<->device transfer in the loop raises
                    with jax.transfer_guard(self._transfer_guard):
                        self.core.step()
            except Exception as e:  # noqa: BLE001 - keep serving: fail these requests, not the engine
                self._error = e
                self.core.fail_all(f"engine step failed: {type(e).__name__}: {e}")

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # ------------------------------------------------------------------------------ requests
    def _make_request(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, stream, rid):
        if input_ids is None:
            if prompt is None:
                raise InvalidRequestError("prompt: either prompt or input_ids must be given")
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"prompt: must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt: this model has no tokenizer; pass input_ids instead")
            input_ids = self.tokenizer.encode(prompt).ids
        if isinstance(input_ids, np.ndarray):
            input_ids = input_ids.tolist()
        if not isinstance(input_ids, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in input_ids
        ):
            raise InvalidRequestError("input_ids: must be a list of ints")
        input_ids = [int(t) for t in input_ids]
        if not input_ids:
            raise InvalidRequestError("input_ids: the prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in input_ids if t < 0 or t >= vocab]
        if bad:
            raise InvalidRequestError(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if sampling_params is not None and not isinstance(sampling_params, dict):
            raise InvalidRequestError("sampling_params: must be a dict")
        sp = SamplingParams.from_dict(sampling_params, vocab_size=vocab)
        if self.disable_top_k_top_p and sp.needs_sort(vocab):
            field = "top_p" if sp.top_p < 1.0 else "top_k"
            raise InvalidRequestError(f"sampling_params.{field}: this engine was started with "
                                      "disable_top_k_top_p=True; only greedy, temperature and min_p sampling")
        total = len(input_ids) + sp.max_new_tokens
        if total > self.context_length:
            raise InvalidRequestError(
                f"max_new_tokens: prompt ({len(input_ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
                f"exceeds the context length {self.context_length}"
            )
        if total + self.spec_extra > self.pool_tokens:
            raise InvalidRequestError(
                f"max_new_tokens: prompt + max_new_tokens ({total}) exceeds the KV pool ({self.pool_tokens} tokens)"
            )
        if not isinstance(return_logprob, bool):
            raise InvalidRequestError("return_logprob: must be a bool")
        if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) or not (
            0 <= top_logprobs_num <= self.max_top_logprobs
        ):
            raise InvalidRequestError(f"top_logprobs_num: must be an int in [0, {self.max_top_logprobs}]")
        if self.spec is not None:
            # Penalties and logprobs with speculation come with the rest of issue 5.
            for field, neutral in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                   ("presence_penalty", 0.0)):
                if getattr(sp, field) != neutral:
                    raise InvalidRequestError(f"sampling_params.{field}: not supported with speculative decoding yet")
            if return_logprob or top_logprobs_num:
                raise InvalidRequestError("return_logprob: not supported with speculative decoding yet")
        seed = sp.seed if sp.seed is not None else (self.random_seed * 1_000_003 + next(self._seed_counter)) % 2**31
        return Request(rid=rid or uuid.uuid4().hex, input_ids=input_ids, sampling=sp, seed=seed,
                       return_logprob=return_logprob or top_logprobs_num > 0, top_logprobs_num=top_logprobs_num,
                       stream=stream, stream_queue=queue.Queue() if stream else None)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 top_logprobs_num=0, stream=False, rid=None):
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list of dicts).

        With stream=True (single prompt only) returns an iterator of incremental dicts.
        """
        if self._stopped:
            raise JspecError("engine is shut down")
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
                                   top_logprobs_num, False, rids[i])
                for i in range(n)
            ]
        else:
            reqs = [self._make_request(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                       stream, rid)]
        for r in reqs:
            self.core.submit(r)
        self._notify()
        if stream:
            return self._stream(reqs[0])
        for r in reqs:
            r.done.wait()
        outs = [self._result(r) for r in reqs]
        return outs if batch else outs[0]

    def _text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        text = self.core.detok.decode(req.output_ids, req.sampling.skip_special_tokens)
        if req.stop_text_end is not None:
            text = (req.detok_state.text if req.detok_state is not None else text)[:req.stop_text_end]
        return text

    def _meta(self, req: Request) -> dict:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "finish_reason": req.finish_reason,
            "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival_time,
        }
        if req.first_token_time is not None:
            meta["ttft"] = req.first_token_time - req.arrival_time
        if self.spec is not None:
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = len(req.output_ids) / max(req.spec_verify_ct, 1)
        if req.return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(req.output_logprobs, req.output_ids)]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in row] for row in req.output_top_logprobs]
        return meta

    def _result(self, req: Request) -> dict:
        return {"text": self._text(req), "output_ids": list(req.output_ids), "meta_info": self._meta(req)}

    def _stream(self, req: Request):
        sent_ids = 0
        sent_text = ""
        while True:
            final = req.stream_queue.get()
            ids = req.output_ids[sent_ids:]
            state = req.detok_state
            text = self._text(req) if final else (state.text if state is not None else "")
            piece = text[len(sent_text):] if text.startswith(sent_text) else text
            sent_ids += len(ids)
            sent_text = text
            if final or ids:
                yield {"text": piece, "output_ids": list(ids), "meta_info": self._meta(req)}
            if final:
                return

    def abort(self, rid: str) -> bool:
        ok = self.core.abort(rid)
        self._notify()
        return ok

    def get_server_info(self) -> dict:
        return {
            **self.server_args,
            "num_total_pages": self.pages.num_usable,
            "num_free_pages": self.pages.num_free,
            "num_total_slots": self.slots.num_slots - 1,
            "num_free_slots": self.slots.num_free,
            "num_running_requests": len(self.scheduler.running),
            "num_waiting_requests": len(self.scheduler.waiting) + len(self.core.inbox),
            "num_retractions": self.scheduler.num_retractions,
            "num_steps": dict(self.core.num_steps),
            "num_generated_tokens": self.core.num_generated,
            "compile_seconds": self.runner.compile_seconds,
            **self._spec_info(),
            "last_error": None if self._error is None else repr(self._error),
            "jax_version": jax.__version__,
            "device": str(jax.devices()[0].device_kind),
        }

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
