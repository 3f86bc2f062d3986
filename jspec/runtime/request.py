"""One generation request as the host sees it (tokens, resources, progress, results), and how a
caller's arguments become one: `make_request` validates them against the engine's `RequestLimits`
in the caller's thread, so a bad request raises `InvalidRequestError` naming the field there and
never reaches the engine loop."""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
import time
import uuid

import numpy as np

from jspec.errors import InvalidRequestError
from jspec.runtime.detokenizer import DetokState
from jspec.runtime.grammar import GRAMMAR_KEYS, Grammar, GrammarBackend
from jspec.runtime.sampling_params import SEED_LIMIT, SamplingParams
from jspec.runtime.step_inputs import MAX_HELD_STOPS

_INPUT_TOP_LOCK = threading.Lock()  # readers building a request's pending input top rows, one at a time


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int  # explicit seed, or one drawn from the engine's random_seed
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    grammar: "Grammar | None" = None  # structured output: the grammar state its accepted tokens reached
    held_stops: tuple[int, ...] = ()  # min_new_tokens: the stop tokens held back (EOS ids, stop_token_ids)
    # SGLang's input_token_logprobs: from prompt position logprob_start_len on (-1: none), one entry
    # per prompt token, (None for the first token of all, which nothing predicts).
    logprob_start_len: int = -1
    # Top logprob rows are built once, in meta_info's format (`top_rows`), and handed out as they are.
    # A prompt step's input top rows arrive as arrays (`input_top_pending`, appended by the engine
    # loop) and are built by the reader (`input_top_rows`): thousands of tuples per prompt chunk,
    # off the loop's path between one step's results and the next launch.
    input_logprobs: list = dataclasses.field(default_factory=list)
    input_top_logprobs: list = dataclasses.field(default_factory=list)
    input_top_pending: list = dataclasses.field(default_factory=list)  # (top logprobs, ids) `[n, k]` arrays

    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int, None]]] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: dict | None = None
    aborted: str | None = None  # abort message, set from any thread; acted on by the loop

    # Device resources (host bookkeeping).
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0  # tokens whose KV is (or is being) written by dispatched steps
    prefill_target: int = 0  # kv_len at which the prefill phase ends (prompt + re-fed outputs)
    scheduled_outputs: int = 0  # output tokens that dispatched steps will produce
    admit_order: int = 0
    num_retractions: int = 0
    spec_verify_ct: int = 0  # speculative verify steps this request took part in
    spec_inflight: int = 0  # speculative steps dispatched for it whose results are not read yet
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (SGLang's meta_info field)
    cache_node: object = None  # the prefix-cache node it reads (locked while it runs)
    branch_at: int = 0  # hybrid prefix cache: a prompt chunk ends here so that a snapshot is taken
    track: tuple | None = None  # hybrid: (length, snapshot row) of its newest decode-time GDN state
    track_pending: tuple | None = None  # ... speculative: (boundary, row) a step in flight may fill
    page_keys: tuple | None = None  # ((prefill_target, limit), its prefix-cache page keys), while it waits

    # Timing and streaming.
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    stream_queue: "queue.Queue | None" = None
    detok_state: "DetokState | None" = None  # incremental detokenization (stop strings, streaming)
    stop_text_end: int | None = None  # where a matched stop string starts in the output text

    @property
    def input_logprob_next(self) -> int:
        """The prompt position whose logprob comes next (len(input_ids): all there, or none wanted)."""
        if self.logprob_start_len < 0:
            return len(self.input_ids)
        return self.logprob_start_len + len(self.input_logprobs)

    def input_top_rows(self) -> list:
        """input_top_logprobs with every pending chunk built in (in meta_info's format). Any thread:
        the loop only appends to input_top_pending; readers take its chunks in order under a lock."""
        if self.input_top_pending:
            with _INPUT_TOP_LOCK:
                while self.input_top_pending:
                    lps, ids = self.input_top_pending[0]
                    self.input_top_logprobs += top_rows(lps.tolist(), ids.tolist())
                    del self.input_top_pending[0]
        return self.input_top_logprobs

    def wants_input_logprobs(self, start: int, n: int) -> bool:
        """Whether a prompt chunk at KV indices start .. start + n - 1 computes logprobs this request
        asked for (position p gives the logprob of prompt token p + 1). Decided from the positions,
        not from what has arrived: with overlap the previous chunk's results are still in flight."""
        if self.input_logprob_next >= len(self.input_ids):
            return False
        lo, hi = max(self.logprob_start_len, 1) - 1, len(self.input_ids) - 2
        return start <= hi and start + n - 1 >= lo

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What an engine can serve: a request beyond these is refused before it is queued. spec_extra:
    KV indices past a request's length that speculation may write."""

    vocab_size: int
    context_length: int
    pool_tokens: int
    spec_extra: int
    max_top_logprobs: int
    disable_top_k_top_p: bool
    eos_token_ids: tuple[int, ...] = ()
    input_logprobs: bool = False  # prompt chunks can report input token logprobs


def make_request(limits: RequestLimits, tokenizer, *, prompt, input_ids, sampling_params, return_logprob,
                 top_logprobs_num, stream, rid, next_seed, grammars: GrammarBackend | None = None,
                 logprob_start_len: int = -1) -> Request:
    """A validated `Request` from `Engine.generate`'s arguments (text is tokenized here, a grammar
    compiled with `grammars`); next_seed(): the seed of a request that names none."""
    if input_ids is None:
        if prompt is None:
            raise InvalidRequestError("prompt: either prompt or input_ids must be given")
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt: must be a string, got {type(prompt).__name__}")
        if tokenizer is None:
            raise InvalidRequestError("prompt: this model has no tokenizer; pass input_ids instead")
        input_ids = tokenizer.encode(prompt).ids
    if isinstance(input_ids, np.ndarray):
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)) or not all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in input_ids
    ):
        raise InvalidRequestError("input_ids: must be a list of ints")
    input_ids = [int(t) for t in input_ids]
    if not input_ids:
        raise InvalidRequestError("input_ids: the prompt is empty")
    vocab = limits.vocab_size
    bad = [t for t in input_ids if t < 0 or t >= vocab]
    if bad:
        raise InvalidRequestError(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise InvalidRequestError("sampling_params: must be a dict")
    sp = SamplingParams.from_dict(sampling_params, vocab_size=vocab)
    if limits.disable_top_k_top_p and sp.needs_sort(vocab):
        field = "top_p" if sp.top_p < 1.0 else "top_k"
        raise InvalidRequestError(f"sampling_params.{field}: this engine was started with "
                                  "disable_top_k_top_p=True; only greedy, temperature and min_p sampling")
    total = len(input_ids) + sp.max_new_tokens
    if total > limits.context_length:
        raise InvalidRequestError(
            f"max_new_tokens: prompt ({len(input_ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) "
            f"exceeds the context length {limits.context_length}"
        )
    if total + limits.spec_extra > limits.pool_tokens:
        raise InvalidRequestError(
            f"max_new_tokens: prompt + max_new_tokens ({total}) exceeds the KV pool ({limits.pool_tokens} tokens)"
        )
    if not isinstance(return_logprob, bool):
        raise InvalidRequestError("return_logprob: must be a bool")
    if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) or not (
        0 <= top_logprobs_num <= limits.max_top_logprobs
    ):
        raise InvalidRequestError(f"top_logprobs_num: must be an int in [0, {limits.max_top_logprobs}]")
    if stream and sp.n > 1:
        raise InvalidRequestError(f"sampling_params.n: a streamed request returns one sample, got n = {sp.n}")
    grammar = None
    key = next((k for k in GRAMMAR_KEYS if getattr(sp, k) is not None), None)
    if key is not None:
        if grammars is None:
            raise InvalidRequestError(f"sampling_params.{key}: structured output is off on this engine; start it "
                                      "with grammar_backend='llguidance'")
        grammar = grammars.compile(key, getattr(sp, key))
    if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool) or not (
            -1 <= logprob_start_len < len(input_ids)):
        raise InvalidRequestError(f"logprob_start_len: must be an int in [-1, {len(input_ids)}) (the prompt), "
                                  f"got {logprob_start_len!r}")
    if logprob_start_len >= 0 and not limits.input_logprobs:
        raise InvalidRequestError("logprob_start_len: input token logprobs are off on this engine; start it with "
                                  "enable_input_logprobs=True")
    held = ()
    if sp.min_new_tokens:
        held = tuple(sorted(set(limits.eos_token_ids) | set(sp.stop_token_ids or ())))
        if len(held) > MAX_HELD_STOPS:
            raise InvalidRequestError(f"sampling_params.min_new_tokens: holds back at most {MAX_HELD_STOPS} stop "
                                      f"tokens (EOS and stop_token_ids), this request has {len(held)}")
    seed = sp.seed if sp.seed is not None else next_seed()
    req = Request(rid=rid or uuid.uuid4().hex, input_ids=input_ids, sampling=sp, seed=seed,
                  return_logprob=return_logprob or top_logprobs_num > 0 or logprob_start_len >= 0,
                  top_logprobs_num=top_logprobs_num, stream=stream, stream_queue=queue.Queue() if stream else None,
                  grammar=grammar, held_stops=held, logprob_start_len=logprob_start_len)
    if logprob_start_len == 0:  # nothing predicts the first token
        req.input_logprobs.append(None)
        req.input_top_logprobs.append(None)
    return req


def top_rows(logprobs: list[list[float]], ids: list[list[int]]) -> list[list[tuple[float, int, None]]]:
    """Top logprob rows (Python lists of k logprobs and of k ids, one per token) in SGLang's
    meta_info format: [(logprob, id, None)] per token (None: the token's text, which SGLang fills
    only on request). Built in C (zip), once per token; a streamed request's chunks reuse them."""
    if not logprobs:
        return []
    nones = (None,) * len(logprobs[0])
    return [list(zip(a, b, nones)) for a, b in zip(logprobs, ids)]


def parallel_samples(req: Request, next_seed) -> list[Request]:
    """SGLang's parallel sampling (n > 1): the request and n - 1 more of its prompt, `{rid}-{j}`,
    each with its own seed (the request's seed + j, or one drawn per sample when it named none).
    They queue one after the other, so the prompt is computed once: a prompt's chunks join the
    prefix cache as they are planned and take the step's whole chunk budget until the last one,
    and the samples behind it are admitted in that step or later, reusing every full page."""
    sp = req.sampling
    samples = [req]
    for j in range(1, sp.n):
        seed = (sp.seed + j) % SEED_LIMIT if sp.seed is not None else next_seed()
        samples.append(Request(rid=f"{req.rid}-{j}", input_ids=list(req.input_ids), sampling=sp, seed=seed,
                               return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                               grammar=None if req.grammar is None else req.grammar.copy(),
                               held_stops=req.held_stops, logprob_start_len=req.logprob_start_len,
                               input_logprobs=list(req.input_logprobs),
                               input_top_logprobs=list(req.input_top_rows())))
    return samples
