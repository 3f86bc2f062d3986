"""The scheduler on its own (host only, no device): FCFS admission, chunked prefill, alternation and
mixed chunks, page planning (plain and speculative), retraction, and the page / slot accounting
invariants over random request sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jspec.cache.allocator import PageAllocator, SlotAllocator
from jspec.models.batch import ForwardMode
from jspec.runtime.request import Request, Status
from jspec.runtime.sampling_params import SamplingParams
from jspec.runtime.scheduler import NeedSync, Scheduler

PAGE = 4


def make(num_pages=32, num_slots=5, chunk=8, **kw) -> Scheduler:
    kw = {"max_running_requests": num_slots - 1, "chunked_prefill_size": chunk, "max_extend_requests": 4,
          "max_decode_requests": num_slots - 1, **kw}
    return Scheduler(PageAllocator(num_pages, PAGE), SlotAllocator(num_slots), **kw)


def request(rid: str, prompt_len: int, max_new: int = 4) -> Request:
    return Request(rid=rid, input_ids=list(range(1, prompt_len + 1)), sampling=SamplingParams(max_new_tokens=max_new),
                   seed=0)


def apply(sched: Scheduler, plan) -> None:
    """What the engine does with a plain step's results: each sampling row gets a token; a request
    with all its tokens finishes (its pages and slot go back)."""
    for s in plan.reqs:
        if s.sample:
            s.req.output_ids.append(7)
            if len(s.req.output_ids) >= s.req.sampling.max_new_tokens:
                sched.finish(s.req, {"type": "length"})


def check_accounting(sched: Scheduler) -> None:
    owned = [p for r in sched.running for p in r.pages]
    assert len(owned) == len(set(owned)), "a page owned twice"
    assert 0 not in owned, "the sink page handed out"
    assert sched.pages.num_free + len(owned) == sched.pages.num_usable
    slots = [r.slot for r in sched.running]
    assert None not in slots and len(slots) == len(set(slots)) and 0 not in slots
    assert sched.slots.num_free + len(slots) == sched.slots.num_slots - 1
    for r in sched.waiting:
        assert r.slot is None and not r.pages and r.kv_len == 0
    for r in sched.running:  # pages cover what the dispatched steps write
        assert len(r.pages) >= sched.pages.pages_for(r.kv_len)


def test_fcfs_chunked_prefill_continues_before_admitting():
    sched = make(chunk=8)
    a, b = request("a", 20), request("b", 3)
    sched.add(a)
    sched.add(b)
    plans = []
    for _ in range(3):
        plan = sched.schedule(inflight=False)
        plans.append([(s.req.rid, s.num_tokens, s.sample) for s in plan.reqs])
        assert plan.mode is ForwardMode.EXTEND
        check_accounting(sched)
        apply(sched, plan)
    # a's 20 tokens in chunks of 8, 8, 4; b waits (FCFS, budget spent) and rides the third step.
    assert plans == [[("a", 8, False)], [("a", 8, False)], [("a", 4, True), ("b", 3, True)]]
    assert a.slot == 1 and b.slot == 2 and a.kv_len == 20 and len(a.pages) == 5
    # The page updates of every plan rebuild each request's page list.
    assert b.status is Status.RUNNING and len(b.pages) == 1


def test_a_prompt_that_does_not_fit_blocks_later_ones():
    sched = make(num_pages=4, chunk=64)  # 3 usable pages = 12 tokens
    big, small = request("big", 16), request("small", 2)
    sched.add(big)
    sched.add(small)
    assert sched.schedule(inflight=False) is None  # big cannot start; small must not jump the queue
    assert list(sched.waiting) == [big, small] and sched.pages.num_free == 3


def test_prefill_and_decode_alternate_and_mixed_chunks_ride_along():
    extend, decode = ForwardMode.EXTEND, ForwardMode.DECODE
    expected = {
        # a decodes between b's chunks, so neither starves the other
        "alternate": [(decode, ["a"]), (extend, ["b"]), (decode, ["a"]), (extend, ["b"]), (decode, ["a", "b"])],
        # a rides along as a one-token row in an extend step whose chunk budget has room for it
        "mixed": [(extend, ["b"]), (extend, ["a", "b"]), (decode, ["a", "b"]), (decode, ["a", "b"]),
                  (decode, ["a", "b"])],
        # b's prompt runs to its end before a decodes again
        "prefill_first": [(extend, ["b"]), (extend, ["b"]), (decode, ["a", "b"]), (decode, ["a", "b"]),
                          (decode, ["a", "b"])],
    }
    for order, want in expected.items():
        sched = make(chunk=8, enable_mixed_chunk=order == "mixed", prefill_first=order == "prefill_first")
        a = request("a", 3, max_new=10)
        sched.add(a)
        apply(sched, sched.schedule(inflight=False))  # a's prompt; a samples its first token
        sched.add(request("b", 10, max_new=10))
        modes = []
        for _ in range(5):
            plan = sched.schedule(inflight=False)
            modes.append((plan.mode, sorted(s.req.rid for s in plan.reqs)))
            check_accounting(sched)
            apply(sched, plan)
        assert modes == want, order
        assert sched.num_mixed_decode_rows == (1 if order == "mixed" else 0)


def test_prefill_first_decodes_when_no_prompt_can_advance():
    # The pool holds a's prompt and its decode pages, not b's as well: b waits, a keeps decoding.
    sched = make(num_pages=5, chunk=64, prefill_first=True)  # 4 usable pages = 16 tokens
    a, b = request("a", 8, max_new=4), request("b", 12, max_new=4)
    sched.add(a)
    apply(sched, sched.schedule(inflight=False))
    sched.add(b)
    plan = sched.schedule(inflight=False)
    assert plan.mode is ForwardMode.DECODE and [s.req.rid for s in plan.reqs] == ["a"]
    assert list(sched.waiting) == [b]
    check_accounting(sched)


def test_decode_allocates_pages_as_tokens_cross_them():
    sched = make()
    a = request("a", 4, max_new=6)
    sched.add(a)
    apply(sched, sched.schedule(inflight=False))
    assert len(a.pages) == 1  # 4 prompt tokens fill one page
    plan = sched.schedule(inflight=False)  # writes KV index 4: a second page
    assert plan.mode is ForwardMode.DECODE and len(plan.page_updates) == 1
    slot, idx, page = plan.page_updates[0]
    assert (slot, idx, page) == (a.slot, 1, a.pages[1])
    apply(sched, plan)
    assert sched.schedule(inflight=False).page_updates == []  # index 5: same page


def test_out_of_pages_retracts_the_newest_request_or_asks_for_a_sync():
    sched = make(num_pages=5, chunk=64)  # 4 usable pages
    a, b = request("a", 7, max_new=8), request("b", 4, max_new=8)
    sched.add(a)
    sched.add(b)
    apply(sched, sched.schedule(inflight=False))  # a: 2 pages, b: 1 page, 1 free
    apply(sched, sched.schedule(inflight=False))  # decode: a writes index 7, b index 4 on the last page
    assert sched.pages.num_free == 0 and len(b.output_ids) == 2
    with pytest.raises(NeedSync):  # in overlap mode the loop must read in-flight results first
        sched.schedule(inflight=True)
    assert b in sched.running
    plan = sched.schedule(inflight=False)  # a needs a page for index 8: b (admitted last) is retracted
    assert [s.req.rid for s in plan.reqs] == ["a"]
    assert sched.num_retractions == 1 and b.num_retractions == 1
    assert list(sched.waiting) == [b] and b.slot is None and not b.pages
    assert b.prefill_target == len(b.all_ids) == 6 and b.scheduled_outputs == 2  # prompt + outputs refed
    check_accounting(sched)


def test_speculative_decode_plans_pages_for_the_longest_acceptance():
    sched = make(num_pages=32, chunk=64, spec_tokens=4, spec_max_accept=4)
    a = request("a", 4, max_new=30)
    sched.add(a)
    apply(sched, sched.schedule(inflight=False))
    plan = sched.schedule(inflight=True)  # writes indices 4..7: pages for 8 tokens
    assert len(a.pages) == 2 and a.spec_inflight == 1 and a.kv_len == 4
    plan = sched.schedule(inflight=True)  # one step in flight may accept 4: indices up to 4 + 4 + 4
    assert len(a.pages) == 3 and a.spec_inflight == 2 and len(plan.page_updates) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]), st.integers(1, 30),
                              st.integers(1, 12)), max_size=60))
def test_random_request_sequences_never_leak_or_double_own(ops):
    sched = make(num_pages=12, num_slots=4, chunk=8)
    n = 0
    for op, length, max_new in ops:
        if op == "add":
            sched.add(request(str(n), length, max_new))
            n += 1
        elif op == "abort" and (sched.running or sched.waiting):
            victims = list(sched.running) + list(sched.waiting)
            sched.finish(victims[length % len(victims)], {"type": "abort"})
        else:
            plan = sched.schedule(inflight=False)
            if plan is not None:
                check_accounting(sched)
                apply(sched, plan)
        check_accounting(sched)
    for _ in range(2000):  # everything left finishes
        plan = sched.schedule(inflight=False)
        if plan is None:
            break
        apply(sched, plan)
    assert not sched.running and not any(r.kv_len for r in sched.waiting)
    if not sched.waiting:
        sched.pages.check_all_free()
        sched.slots.check_all_free()


# ----------------------------------------------------------------------------- with the prefix cache


def grouped_request(rid: str, group: int, prefix_len: int, tail_len: int, max_new: int) -> Request:
    """A prompt of a prefix group (shared first prefix_len tokens) with its own tail."""
    ids = [1000 * (group + 1) + i for i in range(prefix_len)] + [5000 + int(rid) * 50 + i for i in range(tail_len)]
    return Request(rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=max_new), seed=0)


def test_lpm_admits_the_longest_cached_prefix_first():
    from jspec.cache.radix_cache import RadixCache

    for policy, first in (("fcfs", "1"), ("lpm", "2")):
        pages = PageAllocator(64, PAGE)
        sched = Scheduler(pages, SlotAllocator(5), max_running_requests=1, chunked_prefill_size=64,
                          max_extend_requests=4, max_decode_requests=1, radix_cache=RadixCache(pages),
                          prefix_pages_per_step=16, schedule_policy=policy)
        warm = grouped_request("0", 0, 16, 2, 1)
        sched.add(warm)
        while sched.has_work():
            apply(sched, sched.schedule(inflight=False))
        sched.add(grouped_request("1", 1, 16, 2, 1))  # nothing cached
        sched.add(grouped_request("2", 0, 16, 3, 1))  # 16 tokens cached
        plan = sched.schedule(inflight=False)
        assert [s.req.rid for s in plan.reqs] == [first], policy
        assert plan.reqs[0].start == (16 if first == "2" else 0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "follow", "step", "step", "step", "abort"]), st.integers(0, 2),
                              st.integers(0, 9), st.integers(1, 6)), max_size=60),
       bigram=st.booleans(), lpm=st.booleans(), hybrid=st.booleans())
# A prompt's second chunk ends at 12 and snapshots there in the step that admits the next prompt of
# its group, which must not load that snapshot (written after the step's forward).
@example(ops=[("add", 0, 0, 1), ("add", 0, 3, 1), ("step", 0, 0, 1), ("step", 0, 0, 1)], bigram=False, lpm=False,
         hybrid=True)
# Three unfinished prompts (follow-ups of finished chats) come to hold the whole pool between them.
@example(ops=[("add", 2, 4, 3), ("add", 2, 6, 3)] + [("add", 0, 0, 1)] * 3 + [("step", 0, 0, 1)] * 5
         + [("follow", 0, 0, 1)] * 2 + [("step", 0, 0, 1)] * 4 + [("follow", 0, 7, 1)], bigram=False, lpm=True,
         hybrid=True)
def test_cache_reference_counts_and_page_contents_over_random_sequences(ops, bigram, lpm, hybrid):
    """Requests of three prefix groups, aborts, a pool small enough to evict and retract. After
    every call: each page's reference count is the requests that hold it plus one if the tree
    does (so never negative, and nothing leaks); no step writes into a cached page; every cached
    page holds exactly the tokens of its key; node locks count the running requests under them.
    Hybrid (two snapshot rows): a simulated GDN state (the tokens it has seen) shows that every
    chunk starts from exactly the state of the tokens before it, whether loaded from a snapshot
    or built by the request. At the end a flush returns every page and snapshot row."""
    from jspec.cache.radix_cache import RadixCache

    pages = PageAllocator(14, PAGE)  # 13 usable: three running requests can outgrow it
    cache = RadixCache(pages, bigram=bigram, state_slots=[4, 5] if hybrid else None)
    slot_state: dict[int, list] = {}  # slot or snapshot row -> the tokens its state has absorbed
    sched = Scheduler(pages, SlotAllocator(4), max_running_requests=3, chunked_prefill_size=8, max_extend_requests=4,
                      max_decode_requests=3, radix_cache=cache, prefix_pages_per_step=8, track_interval=PAGE,
                      schedule_policy="lpm" if lpm else "fcfs")
    content: dict[int, list] = {}  # page -> the token at each offset, as the device would hold it

    def nodes():
        stack, out = [cache.root], []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            out.extend([n] if n is not cache.root else [])
        return out

    def check():
        tree = {n.page: n for n in nodes()}
        held = [p for r in sched.running for p in r.pages]
        for p in range(1, pages.num_pages):
            assert pages._refs[p] == held.count(p) + (p in tree), p
        for page, n in tree.items():
            tokens = cache.key_tokens(n.key)
            assert content[page] == tokens, (page, content[page], n.key)
        for n in nodes():
            readers = sum(1 for r in sched.running if r.cache_node is not None and _under(r.cache_node, n))
            assert n.lock_ref == readers, (n.lock_ref, readers)
        check_accounting_shared(sched)

    def step():
        cached = {n.page: n for n in nodes()}
        plan = sched.schedule(inflight=False)
        if plan is None:
            return
        # Planning may evict a page and hand it out again, and a chunk's pages join the cache as it is
        # dispatched: only a page cached before and after planning, as the same node, must stay unwritten.
        cached = {n.page for n in nodes() if cached.get(n.page) is n}
        for s in plan.reqs:  # before the forward: snapshot loads, fresh states for new requests
            if s.state_load >= 0:
                slot_state[s.req.slot] = list(slot_state[s.state_load])
            elif s.reset:
                slot_state[s.req.slot] = []
        for s in plan.reqs:  # the forward: each chunk continues the state of the tokens before it
            if hybrid:
                assert slot_state[s.req.slot] == s.req.all_ids[:s.start], (s.req.rid, s.start)
            slot_state[s.req.slot] = s.req.all_ids[:s.start + s.num_tokens]
        for s in plan.reqs:  # after it: snapshots
            if s.state_save >= 0:
                slot_state[s.state_save] = list(slot_state[s.req.slot])
        for slot, row in plan.tracks:  # decode-time states
            slot_state[row] = list(slot_state[slot])
        for s in plan.reqs:  # the KV the step writes: the request's token at each position
            for pos in range(s.start, s.start + s.num_tokens):
                page = s.req.pages[pos // PAGE]
                assert page not in cached, f"a step writes cached page {page}"
                content.setdefault(page, [None] * PAGE)[pos % PAGE] = s.req.all_ids[pos]
        apply(sched, plan)

    made = []
    for op, group, tail, max_new in ops:
        # A chat short enough for its next turn to fit the pool, finished with all its tokens.
        done = [r for r in made if r.finished and r.finish_reason["type"] == "length" and len(r.all_ids) <= 30]
        if op == "add" or (op == "follow" and not done):
            made.append(grouped_request(str(len(made)), group, 12, tail, max_new))
            sched.add(made[-1])
        elif op == "follow":  # the next turn of a finished chat: its prompt and reply, then more
            base, n = done[(group + tail) % len(done)], len(made)
            made.append(Request(rid=str(n), input_ids=base.all_ids + [6000 + n * 10 + i for i in range(tail + 1)],
                                sampling=SamplingParams(max_new_tokens=max_new), seed=0))
            sched.add(made[-1])
        elif op == "abort" and (sched.running or sched.waiting):
            victims = list(sched.running) + list(sched.waiting)
            sched.finish(victims[(group + tail) % len(victims)], {"type": "abort"})
        else:
            step()
        check()
    for _ in range(2000):
        if not sched.has_work():
            break
        step()
        check()
    assert not sched.has_work()
    assert cache.flush()
    pages.check_all_free()
    sched.slots.check_all_free()
    assert sorted(cache.free_states) == ([4, 5] if hybrid else [])


def _under(node, ancestor) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def check_accounting_shared(sched: Scheduler) -> None:
    """check_accounting's slot and coverage invariants where requests may share cached pages."""
    slots = [r.slot for r in sched.running]
    assert None not in slots and len(slots) == len(set(slots)) and 0 not in slots
    for r in sched.waiting:
        assert r.slot is None and not r.pages and r.kv_len == 0
    for r in sched.running:
        assert len(r.pages) >= sched.pages.pages_for(r.kv_len) and len(r.pages) == len(set(r.pages))


def test_a_snapshot_is_not_loaded_by_the_step_that_takes_it():
    """Hybrid cache: request a's second chunk ends at 20 and leaves a snapshot there, in the step
    that b (a's 20 tokens + 5) could be admitted to. The snapshot is written after that step's
    forward, while b's state would be loaded before it: b waits a step (rather than load the
    snapshot at 12 and recompute 12-20) and then starts from the one at 20."""
    from jspec.cache.radix_cache import RadixCache

    pages = PageAllocator(32, PAGE)
    cache = RadixCache(pages, state_slots=[5, 6, 7])
    sched = Scheduler(pages, SlotAllocator(5), max_running_requests=4, chunked_prefill_size=12,
                      max_extend_requests=4, max_decode_requests=4, radix_cache=cache, prefix_pages_per_step=8)
    a = request("a", 20)
    sched.add(a)
    first = sched.schedule(inflight=False)
    assert [(s.start, s.num_tokens, s.state_save) for s in first.reqs] == [(0, 12, 7)]
    b = Request(rid="b", input_ids=a.input_ids + [90, 91, 92, 93, 94], sampling=SamplingParams(max_new_tokens=2),
                seed=0)
    sched.add(b)
    second = sched.schedule(inflight=False)
    assert [(s.req, s.start, s.num_tokens, s.state_save) for s in second.reqs] == [(a, 12, 8, 6)]  # the snapshot at 20
    assert list(sched.waiting) == [b]  # deferred: the snapshot this step takes serves it
    assert sched.schedule(inflight=False).mode is ForwardMode.DECODE  # a's first decode (alternation)
    third = sched.schedule(inflight=False)
    sb = next(s for s in third.reqs if s.req is b)
    assert (sb.start, sb.state_load, sb.num_tokens) == (20, 6, 5)  # loads the one at 20


@pytest.mark.parametrize("page_size,start,end,interval,want", [
    (16, 0, 200, 64, [64, 128, 192]),  # every kernel-chunk end short of the chunk's end
    (16, 16, 300, 128, [144, 272]),  # chunk ends at start + 64c: the first past 128 and past 256
    (48, 0, 400, 64, [192, 384]),  # only chunk ends on a page boundary
    (16, 0, 64, 64, []),  # the chunk's own end is the chunk-end snapshot's, not an inner one
])
def test_inner_snapshots_sit_at_kernel_chunk_ends(page_size, start, end, interval, want):
    """Snapshots inside a prompt chunk (hybrid prefix cache): where a 64-token kernel chunk of this
    chunk ends on a page boundary, the first such point past each multiple of the interval, each
    attached to its node with a row of its own."""
    from jspec.cache.radix_cache import RadixCache
    from jspec.runtime.prefix_reuse import PrefixReuse

    pages = PageAllocator(64, page_size)
    cache = RadixCache(pages, state_slots=list(range(10, 20)))
    req = Request(rid="r", input_ids=list(range(1, end + 2)), sampling=SamplingParams(max_new_tokens=1), seed=0)
    req.pages = pages.alloc(pages.pages_for(end))
    req.kv_len = end
    cache.insert(req.all_ids, req.pages, end)
    got = PrefixReuse(cache, pages).inner_snapshots(req, start, interval)
    assert [start + k for k, _ in got] == want
    assert len({row for _, row in got}) == len(got) and cache.num_cached_states == len(got)
    for k, row in got:
        assert cache.path_end(req.all_ids, start + k).state == row


def _shared_prefix_hit_rate(track_interval: int) -> float:
    """A generated-shared-prefix run in small: 4 groups x 4 prompts (256 shared tokens + 16 own),
    shuffled, through 4 running requests and as many snapshot rows, each request decoding 8 tokens."""
    import random

    from jspec.cache.radix_cache import RadixCache

    pages = PageAllocator(512, 16)
    cache = RadixCache(pages, state_slots=list(range(5, 9)))
    sched = Scheduler(pages, SlotAllocator(5), max_running_requests=4, chunked_prefill_size=1024,
                      max_extend_requests=4, max_decode_requests=4, radix_cache=cache, prefix_pages_per_step=64,
                      track_interval=track_interval)
    reqs = [grouped_request(str(4 * g + i), g, 256, 16, 8) for g in range(4) for i in range(4)]
    random.Random(0).shuffle(reqs)
    for r in reqs:
        sched.add(r)
    for _ in range(500):
        if not sched.has_work():
            break
        plan = sched.schedule(inflight=False)
        if plan is not None:
            apply(sched, plan)
    assert not sched.has_work()
    return cache.hit_rate


def test_inner_snapshots_do_not_starve_the_branch_points():
    """Hybrid: snapshots inside prompt chunks (track_interval 64: three per group's first prompt)
    fill a small row pool on the paths running requests hold; the snapshots at the groups' branch
    points must still get rows (from them), so the hit rate is no lower than without them."""
    assert _shared_prefix_hit_rate(64) >= _shared_prefix_hit_rate(0) > 0.5
