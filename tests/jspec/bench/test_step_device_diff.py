"""`bench/step_device_diff.py` on hand-made traces: the steady window holds whole step periods after
the last prompt step, and the per-step figures and differences come from the kernels inside it."""

from __future__ import annotations

import pytest

from bench.step_device_diff import base_name, differences, per_step, steady_window

GPU, HOST = 1, 2


def kernel(name, ts, dur):
    return {"ph": "X", "pid": GPU, "tid": 14, "name": name, "ts": ts, "dur": dur}


def host(name, ts, dur=5):
    return {"ph": "X", "pid": HOST, "tid": 7, "name": name, "ts": ts, "dur": dur}


def run(extra_per_step: float) -> list[dict]:
    """A prompt step at 0, then decode steps every 100 us from 100, each with 60 us of GEMM (two
    kernels with module-numbered names) and extra_per_step us of a copy, the device lagging 30 us."""
    events = [host("jspec.dispatch extend B64", 0), kernel("prompt_gemm", 10, 80)]
    for k in range(8):
        t = 100 + 100 * k
        events += [host("jspec.dispatch decode B32", t), kernel(f"gemm_fusion_{k % 2}", t + 30, 30),
                   kernel("gemm_fusion", t + 60, 30)]
        if extra_per_step:
            events.append(kernel("MemcpyD2D", t + 90, extra_per_step))
    return events


def test_names_lose_their_module_numbers():
    assert base_name("loop_select_fusion_39") == "loop_select_fusion"
    assert base_name("paged_attention_causal__1") == "paged_attention_causal"
    assert base_name("nvjet_sm90_tst_64x32_64x16_4x1_v_bz_TNT") == "nvjet_sm90_tst_64x32_64x16_4x1_v_bz_TNT"


def test_the_window_skips_the_prompt_steps_and_the_ends():
    start, end, steps = steady_window(run(0), {GPU}, step="jspec.dispatch decode", after="jspec.dispatch extend",
                                      skip=1, tail=2)
    assert (start, end, steps) == (200, 600, 4)
    with pytest.raises(ValueError, match="fewer than two"):
        steady_window(run(0), {GPU}, step="jspec.dispatch decode", after="jspec.dispatch extend", skip=7, tail=1)


def test_per_step_figures_and_the_differences():
    base, other = run(0), run(4)
    window = steady_window(base, {GPU}, step="jspec.dispatch decode", after="jspec.dispatch extend", skip=1, tail=2)
    a, b = per_step(base, {GPU}, *window), per_step(other, {GPU}, *window)
    assert a["wall_us"] == 100 and a["busy_us"] == 60 and a["idle_us"] == 40 and a["kernels"] == 2
    assert a["by_name"] == {"gemm_fusion": {"us": 60.0, "calls": 2.0}}
    assert b["busy_us"] == 64 and b["kernels"] == 3
    assert differences(a, b, top=1) == [("MemcpyD2D", 0.0, 4.0, 0.0, 1.0)]
