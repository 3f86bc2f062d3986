"""Engine settings and checks shared by the engine tests (plain and speculative): the small settings
every test engine starts from, the no-leak check, the plain greedy reference, greedy equality, a
wait for the engine loop's thread, watches on the loop's reads of the step in flight and on the
split steps' launches."""

from __future__ import annotations

import threading
import time
from collections import deque

# The one definition of a test engine's settings; suites override fields as {**SMALL, "field": v}.
# Speculative engines speculate at every step here (their checks count accepted drafts; no plain
# step variants to compile): tests/jspec/runtime/test_adaptive.py covers speculative_adaptive.
SMALL = dict(dtype="float32", cuda_graph_bs=[1, 2, 4], max_running_requests=4, show_progress=False,
             compilation_cache_dir="none", speculative_adaptive=False)
# Speculative suites: chunked prefill of 8 (long prompts take several chunks), a short context, and
# no top-k / top-p step variants compiled (a test that samples with top_p < 1 asks for them back).
SPEC = {**SMALL, "chunked_prefill_size": 8, "context_length": 96, "disable_top_k_top_p": True}
# One decode batch size (CI time): fewer requests run padded into it.
SPEC_BS4 = {**SPEC, "cuda_graph_bs": [4]}


def check_no_leaks(eng):
    """Once idle, nothing is left behind: every page and state slot is back in its allocator (once
    the prefix cache, which keeps pages on purpose, is flushed), and the server info agrees (all
    pages free, no request running or waiting)."""
    assert eng.wait_idle(30)
    if eng.radix_cache is not None:  # cached prefixes hold pages by design: drop them, then count
        assert eng.flush_cache()
        cache = eng.radix_cache
        assert cache.num_cached_states == 0 and len(set(cache.free_states)) == cache.num_state_slots
    eng.pages.check_all_free()
    eng.slots.check_all_free()
    info = eng.get_server_info()
    assert info["num_free_pages"] == info["num_total_pages"], (info["num_free_pages"], info["num_total_pages"])
    assert info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0, (
        info["num_running_requests"], info["num_waiting_requests"])


def output_ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def plain_greedy(target: str, prompts, sampling_params, *, page_size: int, settings: dict, engine=None):
    """Non-speculative outputs (output ids per prompt) of a plain engine of target. engine: such
    an engine, kept running; by default one is started and shut down."""
    from jspec import Engine

    eng = engine if engine is not None else Engine(target, page_size=page_size, **settings)
    try:
        return output_ids(eng.generate(input_ids=prompts, sampling_params=sampling_params))
    finally:
        if engine is None:
            eng.shutdown()


def generates(eng, prompts, sampling_params, want: list[list[int]]):
    """eng's outputs of prompts equal want (output ids per prompt); returns the outputs."""
    outs = eng.generate(input_ids=prompts, sampling_params=sampling_params)
    got = output_ids(outs)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(got) == len(want) and not bad, f"prompts {bad} differ: {[(got[i], want[i]) for i in bad[:2]]}"
    return outs


def until(done, seconds: float = 30.0) -> bool:
    """Whether `done()` became true within `seconds`, polled every millisecond: for a test thread
    that waits for the engine loop's thread to reach a point."""
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def watch_reads(eng):
    """Wraps `eng.runner.dispatch` -> a function telling, while a step is being dispatched, whether
    the loop gave that dispatch its read of the step in flight (`between`: the runner reads that
    step between the launches it can make at once and the grammar inputs that need it). `del
    eng.runner.dispatch` unwraps."""
    box = {"reads": False}
    dispatch = eng.runner.dispatch

    def recorded(plan, between=None):
        box["reads"] = between is not None
        return dispatch(plan, between=between)

    eng.runner.dispatch = recorded
    return lambda: box["reads"]


def refuses_implicit_transfers() -> bool:
    """Whether this thread runs under `jax.transfer_guard("disallow")`: an implicit host-to-device
    transfer (a numpy operand) raises."""
    import jax.numpy as jnp
    import numpy as np

    try:
        (jnp.ones(2) + np.ones(2)).block_until_ready()
    except Exception:  # noqa: BLE001 - the guard's error type differs between JAX versions
        return True
    return False


def watch_launches(eng, exe, queue: str, part: str, will_read, queued: list, launches: list):
    """Wraps a split step's launch on the launcher thread -> a function that unwraps it. `exe.<queue>`
    (the loop's thread) records in `queued` whether the step in flight was still unread;
    `exe.<part>` (the launcher thread) records in `launches` its thread's name, whether a launch
    queued before the loop's read of that step (`will_read`, from `watch_reads`) saw the read happen
    while it waited to start (on the loop's own thread it would wait forever), and whether implicit
    transfers are refused there."""
    reads, saved = deque(), (getattr(exe, queue), getattr(exe, part))

    def queue_wrapped(*a):
        queued.append(eng.core.pending is not None)
        reads.append(will_read())
        return saved[0](*a)

    def part_wrapped(*a):
        read = not reads.popleft() or until(lambda: eng.core.pending is None)
        launches.append((threading.current_thread().name, read, refuses_implicit_transfers()))
        return saved[1](*a)

    setattr(exe, queue, queue_wrapped)
    setattr(exe, part, part_wrapped)

    def unwrap():
        setattr(exe, queue, saved[0])
        setattr(exe, part, saved[1])
    return unwrap
