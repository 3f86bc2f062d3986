"""Shared by the plain-engine tests (test_engine.py, test_engine_parity.py): the small engine
settings and the no-leak check."""

from __future__ import annotations

SMALL = dict(dtype="float32", cuda_graph_bs=[1, 2, 4], max_running_requests=4, show_progress=False,
             compilation_cache_dir="none")


def check_no_leaks(eng):
    assert eng.wait_idle(30)
    eng.pages.check_all_free()
    eng.slots.check_all_free()
    info = eng.get_server_info()
    assert info["num_free_pages"] == info["num_total_pages"]
    assert info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0
