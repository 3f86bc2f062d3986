"""`bench/trace_summary.py`'s idle attribution on a hand-made trace: the gaps between one GPU's
kernels summed by the kernel pair around them, and the host events that overlap the long ones."""

from __future__ import annotations

from bench.trace_summary import idle_gaps, idle_host_work

GPU, HOST = 1, 2


def kernel(name, ts, dur):
    return {"ph": "X", "pid": GPU, "name": name, "ts": ts, "dur": dur}


def host(name, ts, dur):
    return {"ph": "X", "pid": HOST, "tid": 7, "name": name, "ts": ts, "dur": dur}


# Two steps: a 40 us wait between a and b in step 1, 30 us in step 2; a 1 us launch gap b -> c in
# step 1, none in step 2 (c overlaps b: another stream) and none between the steps.
KERNELS = [kernel("a", 0, 10), kernel("b", 50, 20), kernel("c", 71, 5),
           kernel("a", 77, 10), kernel("b", 117, 20), kernel("c", 127, 15)]
HOSTS = [host("update", 5, 30), host("walk", 12, 10),  # walk nested in update; update ends inside the gap
         host("launch", 82, 50),  # covers the whole second gap
         host("unrelated", 55, 20)]  # only under kernels and the 1 us gap


def test_gaps_are_summed_by_the_kernels_around_them():
    gaps = idle_gaps(KERNELS, steps=2)
    assert gaps[0] == {"before": "a", "after": "b", "us_per_step": 35.0, "gaps_per_step": 1.0}
    assert [g for g in gaps if g["before"] == "b"] == []  # 1 us is under the 2 us threshold


def test_host_work_is_what_overlaps_the_long_gaps():
    work = {w["name"]: w for w in idle_host_work(KERNELS + HOSTS, {GPU}, steps=2)}
    # gaps: [10, 50) and [87, 117), 70 us in all
    assert work["update"]["us_per_step"] == 25 / 2  # [10, 35)
    assert work["walk"]["us_per_step"] == 10 / 2  # [12, 22), also inside update
    assert work["launch"]["us_per_step"] == 30 / 2
    assert abs(work["launch"]["share_of_gaps"] - 30 / 70) < 1e-12
    assert "unrelated" not in work
