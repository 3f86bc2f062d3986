"""The hybrid prefix cache's decode-time GDN snapshots under speculation (host only, simulated
device): speculative steps accept 1 .. 4 tokens each, a number the host learns only when it reads a
step's results, one step later with overlap. Over random request sequences the device model checks
that every state a step starts from is the state of exactly the tokens before it, and that every
snapshot the tree holds is the state of exactly its node's tokens: the commit fills a track row
only in the step whose accepted run passes its boundary, and the host attaches it only after it
has read that step. Nothing leaks: at the end a flush returns every page and snapshot row."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.cache.allocator import PageAllocator, SlotAllocator
from jspec.cache.radix_cache import RadixCache
from jspec.models.batch import ForwardMode
from jspec.runtime.scheduler import NeedSync, Scheduler
from tests.jspec.runtime.test_scheduler import PAGE, check_accounting_shared, grouped_request

MAX_ACCEPT = 4  # tokens a step may accept (drafts + bonus); it writes KV for 4 positions
ROWS = [4, 5, 6, 7]  # snapshot rows past the 3 slots and the sink


class Device:
    """Runs each step at dispatch, in order, as the GPU would: per slot its length (KV index of the
    last token), the tokens it has (decided here: the host learns them from the results), and per
    slot or row the tokens its GDN state has absorbed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.length: dict[int, int] = {}
        self.tokens: dict[int, list] = {}
        self.state: dict[int, list] = {}

    def run(self, plan) -> list:
        if plan.mode is ForwardMode.EXTEND:
            for s in plan.reqs:
                slot = s.req.slot
                if s.state_load >= 0:
                    self.state[slot] = list(self.state[s.state_load])
                elif s.reset:
                    self.state[slot] = []
            for s in plan.reqs:
                slot = s.req.slot
                assert self.state[slot] == s.req.all_ids[:s.start], (s.req.rid, s.start)
                self.state[slot] = s.req.all_ids[:s.start + s.num_tokens]
                self.length[slot] = end = s.start + s.num_tokens
                # The first output, sampled by the prompt's last chunk, is the device's last token.
                self.tokens[slot] = list(s.req.all_ids[:end]) + ([8000 + end] if s.sample else [])
            for s in plan.reqs:
                if s.state_save >= 0:
                    self.state[s.state_save] = list(self.state[s.req.slot])
            return []
        rows = []
        for s in plan.reqs:  # a speculative step: the last token (position l0) and what it accepts
            slot = s.req.slot
            l0 = self.length[slot]
            assert self.state[slot] == self.tokens[slot][:l0], s.req.rid
            count = self.rng.randint(1, MAX_ACCEPT)
            new = [9000 + 37 * int(s.req.rid) + l0 + j for j in range(count)]
            self.tokens[slot] = self.tokens[slot][:l0 + 1] + new
            if s.track is not None and l0 < s.track[0] <= l0 + count:  # the commit's tracked node
                self.state[s.track[1]] = self.tokens[slot][:s.track[0]]
            self.length[slot] = l0 + count
            self.state[slot] = self.tokens[slot][:l0 + count]
            rows.append((s.req, new))
        return rows


def process(sched: Scheduler, plan, rows) -> None:
    """The engine's reading of a step's results (EngineCore._process / _process_spec)."""
    if plan.mode is ForwardMode.EXTEND:
        for s in plan.reqs:
            if s.sample and not s.req.finished:
                s.req.output_ids.append(8000 + s.req.kv_len)  # the first output; the device's last token
                s.req.scheduled_outputs = len(s.req.output_ids)
                if len(s.req.output_ids) >= s.req.sampling.max_new_tokens:
                    sched.finish(s.req, {"type": "length"})
        return
    for req, new in rows:
        if req.finished or req.slot is None:
            continue
        req.spec_inflight -= 1
        take = new[:req.sampling.max_new_tokens - len(req.output_ids)]
        req.output_ids.extend(take)
        sched.accepted(req, len(new))
        if len(req.output_ids) >= req.sampling.max_new_tokens:
            sched.finish(req, {"type": "length"})
        req.scheduled_outputs = len(req.output_ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]), st.integers(0, 2),
                              st.integers(0, 9), st.integers(1, 14)), max_size=50),
       overlap=st.booleans(), seed=st.integers(0, 1000))
def test_speculative_decode_snapshots_hold_exactly_their_tokens(ops, overlap, seed):
    pages = PageAllocator(40, PAGE)
    cache = RadixCache(pages, bigram=True, state_slots=list(ROWS))
    sched = Scheduler(pages, SlotAllocator(4), max_running_requests=3, chunked_prefill_size=8, max_extend_requests=4,
                      max_decode_requests=3, radix_cache=cache, prefix_pages_per_step=8, track_interval=PAGE,
                      spec_tokens=MAX_ACCEPT, spec_max_accept=MAX_ACCEPT)
    device = Device(seed)
    pending = []  # (plan, rows) dispatched, results not read yet

    def read_all():
        while pending:
            process(sched, *pending.pop(0))

    def step():
        try:
            plan = sched.schedule(inflight=bool(pending))
        except NeedSync:
            read_all()
            plan = sched.schedule(inflight=False)
        if plan is None:
            read_all()
            return
        if plan.mode is ForwardMode.EXTEND:
            read_all()  # a prompt step's first token is needed before its request decodes
            process(sched, plan, device.run(plan))
            return
        pending.append((plan, device.run(plan)))
        if not overlap or len(pending) > 1:
            process(sched, *pending.pop(0))

    def check():
        stack = [cache.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.state is not None:
                path, n = [], node
                while n.parent is not None:
                    path = cache.key_tokens(n.key) + path
                    n = n.parent
                assert device.state.get(node.state) == path, (node.state, path)
        check_accounting_shared(sched)
        held = [r.track[1] for r in sched.running if r.track] + [r.track_pending[1] for r in sched.running
                                                                  if r.track_pending]
        assert len(held) == len(set(held)) and not set(held) & set(cache.free_states), "a snapshot row twice"

    made = []
    for op, group, tail, max_new in ops:
        if op == "add":
            made.append(grouped_request(str(len(made)), group, 12, tail, max_new))
            sched.add(made[-1])
        elif op == "abort" and (sched.running or sched.waiting):
            victims = list(sched.running) + list(sched.waiting)
            sched.finish(victims[(group + tail) % len(victims)], {"type": "abort"})
        else:
            step()
        check()
    for _ in range(2000):
        if not sched.has_work() and not pending:
            break
        step()
        check()
    read_all()
    assert not sched.has_work()
    assert cache.flush()
    pages.check_all_free()
    sched.slots.check_all_free()
    assert sorted(cache.free_states) == ROWS
