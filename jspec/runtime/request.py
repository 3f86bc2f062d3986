"""One generation request as the host sees it: tokens, resources, progress, results."""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
import time

from jspec.runtime.detokenizer import DetokState
from jspec.runtime.sampling_params import SamplingParams


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

    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
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
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
