"""The engine loop's cost of waking streamed requests' event loop: a thread standing in for the
engine loop waits for the device (BLOCK_US, the GIL released), does a step's Python work (WORK_US
per request, then STEP_US for the rest of the step) and signals each of N streams once a step, while an asyncio loop on another thread reads
them (as the in-process benchmark client and the HTTP server do); ms per step on the signalling
thread, with one `call_soon_threadsafe` per signal against `jspec.runtime.outputs.LoopSignal`s
held to the step's end (`outputs.batched_signals`, as the engine loop's step holds them): one
hand-over a step. Both threads share the GIL at jspec's switch interval.

    python3 bench/loop_signal_cost.py [--streams 32 --steps 400 --block-us 2000 --work-us 15 --step-us 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jspec.runtime import outputs  # noqa: E402
from jspec.runtime.gil import switch_interval  # noqa: E402


class PerSignal:
    """One wake-up per signal: the hand-over before LoopSignal batched them."""

    def __init__(self, loop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, final: bool) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, final)


def chunk(final: bool) -> dict:
    """A stand-in for building a streamed chunk on the reader's side."""
    return {"text": "", "output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3, "finish_reason": final}}


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def per_step_ms(kind, a, held: bool = False) -> float:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    signals = []

    async def read(s):
        while True:
            final = await s.queue.get()
            chunk(final)
            if final:
                return

    async def main():
        signals.extend(kind(loop) for _ in range(a.streams))
        ready.set()
        await asyncio.gather(*(read(s) for s in signals))

    reader = threading.Thread(target=lambda: loop.run_until_complete(main()))
    reader.start()
    ready.wait()
    t = time.perf_counter()
    for step in range(a.steps):
        time.sleep(a.block_us * 1e-6)  # the wait for the step in flight (the GIL released)
        with outputs.batched_signals() if held else contextlib.nullcontext():  # as EngineCore.step
            for s in signals:
                spin(a.work_us)
                s.put(step == a.steps - 1)
            spin(a.step_us)
    spent = time.perf_counter() - t
    reader.join()
    loop.close()
    return spent / a.steps * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--work-us", type=float, default=15.0)
    ap.add_argument("--step-us", type=float, default=3000.0)
    ap.add_argument("--block-us", type=float, default=2000.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    sys.setswitchinterval(switch_interval())
    ideal = (a.streams * a.work_us + a.step_us + a.block_us) / 1e3
    print(f"# {a.streams} streams, the step's own work {ideal:.3f} ms, switch interval {sys.getswitchinterval()} s")
    for r in range(a.rounds):
        print(f"round {r}: per signal {per_step_ms(PerSignal, a):.3f} ms/step  "
              f"held to the step's end {per_step_ms(outputs.LoopSignal, a, held=True):.3f} ms/step")


if __name__ == "__main__":
    main()
