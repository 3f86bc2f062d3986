"""`bench/trace_timeline.py` on a hand-made trace: the window between two step marks, each stream's
kernels merged into busy blocks, and only the marked host events, named by their thread."""

from __future__ import annotations

from bench.trace_timeline import busy_blocks, timeline

GPU, HOST = 1, 2


def kernel(name, ts, dur, stream=14):
    return {"ph": "X", "pid": GPU, "tid": stream, "name": name, "ts": ts, "dur": dur}


def host(name, ts, dur, tid=7):
    return {"ph": "X", "pid": HOST, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_kernels_merge_while_the_gaps_stay_short():
    blocks = busy_blocks([kernel("b", 14, 6), kernel("a", 0, 10), kernel("c", 40, 5)], merge_us=5)
    assert blocks == [{"start": 0, "end": 20, "count": 2, "first": "a", "last": "b"},
                      {"start": 40, "end": 45, "count": 1, "first": "c", "last": "c"}]


def test_the_window_holds_the_steps_asked_for():
    events = [host("jspec.dispatch decode B32", 0, 90), host("jspec.dispatch decode B32", 100, 90),
              host("jspec.dispatch decode B32", 200, 90),
              host("jspec.grammar_walk", 130, 20), host("PjitFunction(jit(forward))", 120, 40, tid=8),
              host("unmarked python", 125, 5),
              kernel("draft_0", 105, 5), kernel("draft_1", 112, 5), kernel("fwd", 150, 30),
              kernel("MemcpyD2H", 118, 1, stream=18), kernel("late", 250, 5)]
    span, rows = timeline(events, {GPU}, {(HOST, 8): "launcher"}, step="jspec.dispatch decode", first=1, steps=1,
                          merge_us=5)
    assert span == 100
    got = [(r["start"], r["dur"], r["where"], r["count"], r["first"]) for r in rows]
    assert got == [(0, 90, "host 7", 1, "jspec.dispatch decode B32"),
                   (5, 12, "GPU stream 14", 2, "draft_0"),
                   (18, 1, "GPU stream 18", 1, "MemcpyD2H"),
                   (20, 40, "host launcher", 1, "PjitFunction(jit(forward))"),
                   (30, 20, "host 7", 1, "jspec.grammar_walk"),
                   (50, 30, "GPU stream 14", 1, "fwd"),
                   (100, 90, "host 7", 1, "jspec.dispatch decode B32")]
