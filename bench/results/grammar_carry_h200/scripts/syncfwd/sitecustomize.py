"""Experiment (not jspec): SYNC_FWD=1 makes a pipelined constrained step's loop wait, right after
queueing the forward part on the launcher thread, until that launch has returned, so that every
device allocation and free of a step happens in one order (no race between the launcher thread's
temporaries and the loop's frees and uploads): does the forward part's graph then keep its
addresses (no re-record before each launch)?"""
import os
if os.environ.get("SYNC_FWD"):
    from concurrent.futures import Future
    import jspec.runtime.split_step as ss
    _begin = ss.SplitExecutable.begin

    def begin(self, params, state, packed):
        carry = _begin(self, params, state, packed)
        if not self.plain and isinstance(carry[0], Future):
            carry[0].result()
        return carry

    ss.SplitExecutable.begin = begin
