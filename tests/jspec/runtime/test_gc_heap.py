"""The collector held off while logprob rows are built in bulk (`gc_heap.paused`): blocks nest and
overlap across threads, the collector's own state is kept, and the engine's row builders run no
collection in the middle of a prompt's rows."""

from __future__ import annotations

import gc
import threading

import pytest

from jspec.runtime import engine_core, gc_heap, outputs
from jspec.runtime.executable_cache import code_digest
from jspec.runtime.request import Request, top_rows
from jspec.runtime.sampling_params import SamplingParams


@pytest.fixture
def collections():
    """Collections started while the fixture is live (gc.callbacks), restoring the collector after."""
    seen = []
    cb = lambda phase, info: seen.append(info["generation"]) if phase == "start" else None  # noqa: E731
    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(cb)
    yield seen
    gc.callbacks.remove(cb)
    (gc.enable if was else gc.disable)()


def test_blocks_nest_across_threads_and_the_last_one_out_turns_it_back_on(collections):
    inner_in, inner_out = threading.Event(), threading.Event()
    states = []

    def other():
        with gc_heap.paused():
            inner_in.set()
            inner_out.wait(5)
        states.append(gc.isenabled())  # the main thread's block is still open

    with gc_heap.paused():
        t = threading.Thread(target=other)
        t.start()
        inner_in.wait(5)
        assert not gc.isenabled()
        inner_out.set()
        t.join(5)
        assert not gc.isenabled()
    assert states == [False] and gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collections):
    gc.disable()
    with gc_heap.paused():
        pass
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(RuntimeError):
        with gc_heap.paused():
            raise RuntimeError("a builder that raises")
    assert gc.isenabled()


def _prompt_request(n: int) -> Request:
    req = Request(rid="r", input_ids=list(range(n)), sampling=SamplingParams(max_new_tokens=1), seed=0,
                  return_logprob=True, top_logprobs_num=5, logprob_start_len=0)
    req.input_logprobs = [-1.5] * n
    req.input_top_logprobs = top_rows([[-0.5] * 5] * n, [[7] * 5] * n)
    return req


def test_a_long_prompts_rows_are_built_without_a_collection(collections):
    """8,000 tuples are eleven young collections' worth of allocations; held off, none runs while
    they are built and the first allocation after them (as the block closes) runs one."""
    req = _prompt_request(8000)
    rows = outputs._LogprobRows()
    gc.collect()  # no young allocations left over from building the request
    collections.clear()
    tokens, top = rows.update_input(req)
    ran = list(collections)  # copied before this test allocates anything more
    assert ran == [0] and len(tokens) == 8000


def test_the_engine_builds_a_steps_rows_with_the_collector_held_off(monkeypatch):
    """The engine loop's row building (`_process`, which converts a prompt step's input logprobs and
    every step's output logprobs) runs inside paused()."""
    seen = []
    monkeypatch.setattr(engine_core.EngineCore, "_process_spec", lambda self, h: seen.append(gc.isenabled()))
    core = engine_core.EngineCore.__new__(engine_core.EngineCore)
    core.runner = type("R", (), {"speculative": True})()
    handle = type("H", (), {"bucket": type("B", (), {"mode": engine_core.ForwardMode.DECODE})()})()
    assert gc.isenabled()
    core._process(handle)
    assert seen == [False] and gc.isenabled()


def test_pausing_leaves_the_compiled_step_cache_keys_alone():
    """What paused() remembers must not feed the code digest of the compiled-step cache's keys, or
    the first logprob batch of a process would make every later start-up miss."""
    before = code_digest()
    was = gc.isenabled()
    try:
        for on in (True, False):
            (gc.enable if on else gc.disable)()
            with gc_heap.paused():
                assert code_digest() == before
            assert code_digest() == before
    finally:
        (gc.enable if was else gc.disable)()
