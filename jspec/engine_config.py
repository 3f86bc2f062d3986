"""Every engine setting (SGLang's names), validated once, with what follows from them: the buckets
to compile, the pool sizes, the speculative settings.

`EngineConfig.create` reads the target's (and a drafter's) config.json, never their weights, so a
bad setting fails before anything is loaded; each error is a `ConfigError` naming the setting.
`Engine` only assembles the parts this describes and serves.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from jspec.cache import memory
from jspec.cache.memory import MemoryPlan
from jspec.cache.pool import PoolLayout, size_pools
from jspec.config import ModelConfig, load_config
from jspec.errors import ConfigError
from jspec.models.drafters import dflash_block_size, drafter_config
from jspec.models.loader import Model, resolve_dtype
from jspec.runtime.grammar import BACKENDS as GRAMMAR_BACKENDS
from jspec.sharding import check_tp
from jspec.speculative.config import SpecConfig, check_draft, parse_spec_config

DEFAULT_CUDA_GRAPH_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256]
MAX_EXTEND_REQUESTS = 64  # requests one prompt-chunk step can carry
# Page-table updates a prompt step carries for cached prefixes, at most (12 bytes each, uploaded with
# every prompt step): 64 requests with 4,096-token cached prefixes at page size 16.
MAX_PREFIX_PAGES_PER_STEP = 16384


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Resolved settings. model: the target's directory, or a loaded `Model` (benchmarks build
    random weights); model_config: its config."""

    model: str | Model
    model_config: ModelConfig
    dtype: str
    page_size: int
    max_running_requests: int
    cuda_graph_bs: list[int]  # decode buckets (batch sizes)
    chunked_prefill_size: int
    prefill_token_buckets: list[int]  # prompt-chunk buckets (token counts)
    context_length: int
    layout: PoolLayout
    disable_overlap_schedule: bool = False
    random_seed: int = 0
    enable_mixed_chunk: bool = False
    disable_top_k_top_p: bool = False  # greedy / temperature / min-p only: no sort variant is compiled
    max_top_logprobs_num: int = 20
    skip_tokenizer_init: bool = False
    show_progress: bool = True
    transfer_guard: str | None = None  # jax.transfer_guard level around the loop ("disallow" in tests)
    spec: SpecConfig | None = None
    # KV indices past a request's length that speculation may write: page-table rows and the pool
    # check of every request include them.
    spec_extra: int = 0
    mem_fraction_static: float | None = None
    memory_plan: MemoryPlan | None = None  # set when the pool was sized from the device's memory
    tp_size: int = 1  # devices the target is split over (jspec.sharding)
    ep_size: int = 1  # tp_size: MoE experts split whole over those devices (expert parallelism)
    replicate_attention: bool = False  # tp_size > 1: attention / GDN layers whole on every device
    disable_radix_cache: bool = False  # the prefix cache (on where supported, see radix_cache_enabled)
    schedule_policy: str = "fcfs"  # admission order: "fcfs" or "lpm" (longest cached prefix first)
    prefill_first: bool = False  # prompt-chunk steps before decode whenever a prompt can advance (else alternate)
    max_mamba_cache_size: int | None = None  # hybrid: GDN state rows, running requests + cached snapshots
    mamba_track_interval: int = 256  # hybrid: prompts and decode keep the GDN state about every this many tokens
    grammar_backend: str | None = None  # structured output (regex / json_schema / ebnf): "llguidance"
    tokenizer_path: str | None = None  # a directory with tokenizer.json (default: the model's own)
    enable_input_logprobs: bool = False  # prompt-chunk variants reporting input token logprobs (logprob_start_len)

    @property
    def max_extend_requests(self) -> int:
        return min(self.max_running_requests, MAX_EXTEND_REQUESTS)

    @property
    def pool_tokens(self) -> int:
        return self.layout.pool_tokens

    def cache_context(self) -> str:
        """The settings as the executable cache keys them (`jspec.runtime.executable_cache`):
        without the checkpoints' paths (the runner keys the models by configuration and
        structure, and their weights are arguments), the memory plan (what it decides, the pool
        sizes, is in the steps' argument shapes) or what only the host loop reads."""
        spec = None if self.spec is None else dataclasses.replace(self.spec, draft_model_path=None)
        return repr(dataclasses.replace(self, model=None, spec=spec, memory_plan=None, show_progress=True,
                                        transfer_guard=None, schedule_policy="fcfs", prefill_first=False))

    def server_args(self) -> dict:
        """The settings as `Engine.get_server_info` reports them."""
        return dict(model_path=self.model if isinstance(self.model, str) else self.model.path,
                    dtype=str(resolve_dtype(self.dtype)), page_size=self.page_size,
                    max_running_requests=self.max_running_requests, max_total_tokens=self.pool_tokens,
                    chunked_prefill_size=self.chunked_prefill_size, cuda_graph_bs=list(self.cuda_graph_bs),
                    prefill_token_buckets=list(self.prefill_token_buckets),
                    disable_overlap_schedule=self.disable_overlap_schedule, random_seed=self.random_seed,
                    context_length=self.context_length, disable_top_k_top_p=self.disable_top_k_top_p,
                    enable_mixed_chunk=self.enable_mixed_chunk, mem_fraction_static=self.mem_fraction_static,
                    tp_size=self.tp_size, ep_size=self.ep_size,
                    replicate_attention=self.replicate_attention, disable_radix_cache=self.disable_radix_cache,
                    radix_cache=self.radix_cache_enabled, schedule_policy=self.schedule_policy,
                    prefill_first=self.prefill_first,
                    max_mamba_cache_size=self.layout.num_slots - 1 + self.layout.num_snapshots
                    if self.model_config.is_hybrid else None, mamba_track_interval=self.mamba_track_interval,
                    grammar_backend=self.grammar_backend, tokenizer_path=self.tokenizer_path,
                    enable_input_logprobs=self.enable_input_logprobs)

    @property
    def radix_cache_enabled(self) -> bool:
        """The prefix cache runs unless disabled (hybrid targets: with room for state snapshots)."""
        return not self.disable_radix_cache and (not self.model_config.is_hybrid or self.layout.num_snapshots > 0)

    @property
    def prefix_pages_per_step(self) -> int:
        """Cached pages one prompt step may map into page-table rows (each a row of the step's page
        updates): enough for a whole row (any one request's match fits a step) and for as many
        requests as a step carries each mapping a full row, up to `MAX_PREFIX_PAGES_PER_STEP`.
        Cached tokens cost the step no compute, so a smaller bound would be what limits how fast
        prompts that share a long prefix are admitted."""
        if not self.radix_cache_enabled:
            return 0
        pages_per_seq = self.layout.pages_per_seq
        return max(-(-self.chunked_prefill_size // self.page_size), pages_per_seq,
                   min(self.max_extend_requests * pages_per_seq, MAX_PREFIX_PAGES_PER_STEP))

    @classmethod
    def create(cls, model_path, *, dtype: str = "bfloat16", page_size: int = 16,
               max_running_requests: int | None = None, max_total_tokens: int | None = None,
               chunked_prefill_size: int | None = None, cuda_graph_bs: list[int] | None = None,
               disable_overlap_schedule: bool = False, random_seed: int = 0, context_length: int | None = None,
               mem_fraction_static: float | None = None, prefill_token_buckets: list[int] | None = None,
               max_top_logprobs_num: int = 20, skip_tokenizer_init: bool = False, show_progress: bool = True,
               enable_mixed_chunk: bool = False, transfer_guard: str | None = None,
               disable_top_k_top_p: bool = False, tp_size: int | None = None, ep_size: int | None = None,
               replicate_attention: bool | None = None,
               disable_radix_cache: bool = False, schedule_policy: str = "fcfs", prefill_first: bool = False,
               max_mamba_cache_size: int | None = None, mamba_track_interval: int = 256,
               grammar_backend: str | None = None, tokenizer_path: str | None = None,
               enable_input_logprobs: bool = False, **speculative) -> EngineConfig:
        """Validate SGLang-style keyword settings; `speculative` holds the speculative_* keys."""
        unknown = sorted(k for k in speculative if not k.startswith("speculative_") or k not in SPEC_KEYS)
        if unknown:
            raise ConfigError(f"unknown Engine argument(s): {', '.join(unknown)}")
        config = _target_config(model_path, dtype)
        tp, ep, rep = _tp_size(model_path, config, tp_size, ep_size, replicate_attention)
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
        on_gpu = jax.default_backend() == "gpu"

        spec = parse_spec_config(speculative, target_family=config.family, target_is_hybrid=config.is_hybrid,
                                 draft_block_size=_dflash_block(speculative))
        if spec is not None:
            if enable_mixed_chunk:
                raise ConfigError("enable_mixed_chunk with speculative decoding is not implemented yet")
            _check_draft_config(spec, config, model_path)
        context = int(context_length or config.max_position_embeddings)
        if context < 2:
            raise ConfigError(f"context_length must be >= 2, got {context}")

        bs, max_running = _decode_buckets(cuda_graph_bs, max_running_requests, on_gpu)
        chunk = int(chunked_prefill_size or (8192 if on_gpu else 512))
        if chunk < 1:
            raise ConfigError(f"chunked_prefill_size must be >= 1, got {chunk}")
        buckets = _prefill_buckets(prefill_token_buckets, chunk)

        # A speculative step writes num_draft_tokens positions past the request's current length;
        # with overlap (spec v2) a step already in flight for a request that has just finished may
        # still accept up to num_steps + 1 tokens and write ahead of them.
        spec_extra = 0
        if spec is not None:
            spec_extra = spec.kv_ahead + (0 if disable_overlap_schedule else spec.num_steps + 1)
        if tokenizer_path is not None and not os.path.isfile(os.path.join(tokenizer_path, "tokenizer.json")):
            raise ConfigError(f"tokenizer_path: no tokenizer.json in {tokenizer_path!r}")
        if grammar_backend == "none":
            grammar_backend = None
        if grammar_backend is not None and grammar_backend not in GRAMMAR_BACKENDS:
            raise ConfigError(f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)} or None, "
                              f"got {grammar_backend!r}")
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ConfigError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {schedule_policy!r}")
        if mem_fraction_static is not None and not 0.0 < float(mem_fraction_static) <= 1.0:
            raise ConfigError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static!r}")
        layout = size_pools(page_size=page_size, context_length=context, kv_ahead=spec_extra,
                            max_running_requests=max_running, max_total_tokens=max_total_tokens,
                            from_device_memory=memory.device_memory() is not None)
        if isinstance(mamba_track_interval, bool) or not isinstance(mamba_track_interval, int) \
                or mamba_track_interval < 1:
            raise ConfigError(f"mamba_track_interval must be a positive int, got {mamba_track_interval!r}")
        # Tracked states sit at page boundaries (a cached node ends on one).
        mamba_track_interval = -(-mamba_track_interval // page_size) * page_size
        if config.is_hybrid and not disable_radix_cache:
            layout = dataclasses.replace(layout, num_snapshots=_num_snapshots(max_mamba_cache_size, max_running))
        return cls(model=model_path, model_config=config, dtype=dtype, page_size=page_size,
                   max_running_requests=max_running, cuda_graph_bs=bs, chunked_prefill_size=chunk,
                   prefill_token_buckets=buckets, context_length=context, layout=layout,
                   disable_overlap_schedule=bool(disable_overlap_schedule), random_seed=int(random_seed),
                   enable_mixed_chunk=bool(enable_mixed_chunk), disable_top_k_top_p=bool(disable_top_k_top_p),
                   max_top_logprobs_num=int(max_top_logprobs_num), skip_tokenizer_init=bool(skip_tokenizer_init),
                   show_progress=bool(show_progress), transfer_guard=transfer_guard, spec=spec, spec_extra=spec_extra,
                   mem_fraction_static=mem_fraction_static, tp_size=tp, ep_size=ep,
                   replicate_attention=rep, disable_radix_cache=bool(disable_radix_cache),
                   schedule_policy=schedule_policy,
                   prefill_first=bool(prefill_first),
                   max_mamba_cache_size=max_mamba_cache_size, mamba_track_interval=mamba_track_interval,
                   grammar_backend=grammar_backend, tokenizer_path=None if tokenizer_path is None else str(tokenizer_path),
                   enable_input_logprobs=bool(enable_input_logprobs))

    def with_memory_plan(self, plan: MemoryPlan) -> EngineConfig:
        """This config with the pool sized by `plan` (see `Engine`, which measures it)."""
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, num_pages=plan.num_pages),
                                   memory_plan=plan)


SCHEDULE_POLICIES = ("fcfs", "lpm")


def _num_snapshots(max_mamba_cache_size, max_running: int) -> int:
    """GDN state snapshots the prefix cache of a hybrid target keeps: SGLang's max_mamba_cache_size
    counts every state row, the running requests' included; by default as many snapshots as
    running requests (the state pool doubles)."""
    if max_mamba_cache_size is None:
        return max_running
    if isinstance(max_mamba_cache_size, bool) or not isinstance(max_mamba_cache_size, int) \
            or max_mamba_cache_size <= max_running:
        raise ConfigError(f"max_mamba_cache_size must be an int above max_running_requests={max_running} (the "
                          f"running requests' state rows plus at least one prefix-cache snapshot), got "
                          f"{max_mamba_cache_size!r}; disable_radix_cache=True runs without snapshots")
    return max_mamba_cache_size - max_running

SPEC_KEYS = {
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "speculative_simulate_accept_length",
    "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
    "speculative_adaptive", "speculative_disable_by_batch_size",
}


def _target_config(model_path, dtype) -> ModelConfig:
    if isinstance(model_path, Model):
        return model_path.config
    if not isinstance(model_path, (str, os.PathLike)) or not os.path.isdir(model_path):
        raise ConfigError(f"model_path={model_path!r} is not a directory")
    if not os.path.exists(os.path.join(model_path, "config.json")):
        raise ConfigError(f"model_path={model_path!r} has no config.json")
    resolve_dtype(dtype)
    return load_config(model_path)


def _tp_size(model_path, config: ModelConfig, tp_size, ep_size, replicate_attention) -> tuple[int, int, bool]:
    """(tp_size, ep_size, replicate_attention) of the target: as asked (checked against the config
    and the visible devices), or a loaded model's own; a loaded model split otherwise is a
    ConfigError. ep_size is 1 (experts split by their intermediate dimension) or tp_size (split
    whole); replicate_attention only means something at tp_size > 1 (`jspec.sharding`)."""
    if replicate_attention is not None and not isinstance(replicate_attention, bool):
        raise ConfigError(f"replicate_attention must be a bool, got {replicate_attention!r}")
    if isinstance(model_path, Model):
        have_ep = model_path.tp_size if model_path.expert_parallel else 1
        have_rep = model_path.replicate_attention
        if (tp_size is not None and tp_size != model_path.tp_size) or (ep_size is not None and ep_size != have_ep) \
                or (replicate_attention is not None and replicate_attention != have_rep):
            raise ConfigError(f"tp_size={tp_size}, ep_size={ep_size}, replicate_attention={replicate_attention} but "
                              f"the model passed in is split {model_path.tp_size} ways with ep_size={have_ep}, "
                              f"replicate_attention={have_rep} (jspec.models.loader.shard_model / "
                              "load_model(..., tp_size=N, expert_parallel=..., replicate_attention=...) split a model)")
        return model_path.tp_size, have_ep, have_rep
    tp = 1 if tp_size is None else tp_size
    ep = 1 if ep_size is None else ep_size
    if ep not in (1, tp):
        raise ConfigError(f"ep_size={ep_size} must be 1 or equal to tp_size={tp} (experts split over the same devices)")
    rep = bool(replicate_attention)
    tp = check_tp(config, tp, ep=ep > 1, replicate_attention=rep)
    return tp, ep, rep and tp > 1


def _dflash_block(speculative: dict) -> int | None:
    """DFLASH's trained block size (the default number of draft tokens), from a drafter object or
    its config.json; None for other algorithms or when there is nothing to read it from."""
    if str(speculative.get("speculative_algorithm") or "").upper() != "DFLASH":
        return None
    path = speculative.get("speculative_draft_model_path")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        return getattr(path, "block_size", None)
    return None if not path else dflash_block_size(path)


def draft_source(spec: SpecConfig, model_path) -> tuple[str | None, object]:
    """(checkpoint format, path) of the drafter: NEXTN, and NAIVE_EAGLE without a draft path or
    pointed at the target's own directory, read the target's `mtp.*` layer; a format of None is
    detected from the draft's config.json."""
    target_dir = model_path.path if isinstance(model_path, Model) else model_path
    kind, path = spec.algorithm, spec.draft_model_path
    if kind == "NAIVE_EAGLE":
        kind = "NEXTN" if path is None or _same_dir(path, target_dir) else None
    return kind, target_dir if path is None else path


def _same_dir(a, b) -> bool:
    try:
        return b is not None and os.path.samefile(a, b)
    except OSError:
        return False


def _check_draft_config(spec: SpecConfig, target: ModelConfig, model_path) -> ModelConfig | None:
    """The drafter's config, read from config.json before any weight, so a bad draft directory
    fails here with the error its loader would raise; None for NGRAM. A drafter object
    (benchmarks) brings its own."""
    if spec.draft_kind == "ngram":
        return None
    path = spec.draft_model_path
    if path is not None and not isinstance(path, (str, os.PathLike)):
        return path.config
    if spec.draft_kind == "model":  # STANDALONE: a whole model of the same vocabulary
        if not os.path.isdir(str(path)):
            raise ConfigError(f"speculative_draft_model_path={path!r} is not a directory")
        draft = load_config(path)
        check_draft(spec, target, draft)
        return draft
    kind, path = draft_source(spec, model_path)
    if not os.path.isdir(str(path)):
        raise ConfigError(f"speculative_draft_model_path={path!r} is not a directory")
    return drafter_config(kind, str(path), target)


def _decode_buckets(cuda_graph_bs, max_running_requests, on_gpu: bool) -> tuple[list[int], int]:
    """Decode batch sizes ("CUDA graph" buckets) and the running-request cap."""
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
    return bs, max_running


def _prefill_buckets(buckets, chunk: int) -> list[int]:
    """Prompt-chunk token counts: powers of two from 16 below the chunk size, and the chunk size."""
    if buckets is None:
        buckets, t = [], 16
        while t < chunk:
            buckets.append(t)
            t *= 2
    return sorted(set(int(b) for b in buckets if b <= chunk) | {chunk})
