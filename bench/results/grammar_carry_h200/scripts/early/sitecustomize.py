"""Experiment (not jspec code): the loop thread hands the GIL to the launcher thread as soon as it
queues a pipelined split step's forward part, and waits (at most 2 ms) until the launcher has begun
that launch, instead of running on into reading the previous step while the launcher waits for the
GIL (hypothesis: the forward's launch, 1.4-2.0 ms of host time, is on the steady constrained step's
critical path, and starts several hundred microseconds after it is queued)."""
import threading

import jspec.runtime.split_step as ss


def _queue_forward(self, params, buffers, rest, decisions):
    started = threading.Event()

    def run(*args):
        started.set()
        return ss._launch(*args)

    future = ss.launcher().submit(run, self.guard, self.forward, params, buffers, rest, decisions)
    started.wait(0.002)
    return future


ss.SplitExecutable.queue_forward = _queue_forward
