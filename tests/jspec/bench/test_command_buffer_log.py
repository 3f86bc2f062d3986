"""`bench/command_buffer_log.py` on a hand-made XLA log: re-recordings counted per graph (told apart
by command count), their moved-allocation counts, and the median host time past the warm-up."""

from __future__ import annotations

from bench.command_buffer_log import summarise


def update(commands, moved, us):
    return [f"I1128 command_buffer_thunk.cc:310] [0] Create/Update command buffer by recoding command buffer cmd "
            f"sequence after 1 executions since last update; num_commands={commands}; updated_allocs={moved}; "
            f"is_first_record=0; needs_update=1",
            f"I1128 command_buffer_thunk.cc:340] [0] Updated command buffer in {us} μs; num_commands={commands}",
            "I1128 command_buffer_thunk.cc:350] [0] Execute command buffer; num_executions=1"]


def test_updates_are_counted_per_graph_with_their_moved_allocations():
    lines = ["unrelated line"]
    for us in (5000, 900, 1100, 1000):  # the first is a warm-up record
        lines += update(553, 8, us)
    lines += update(65, 29, 190) + update(65, 30, 200)
    res = summarise(lines, skip=1)
    assert res["graph_553_commands"] == {"updates": 4, "median_us": 1000, "updated_allocs": {"8": 4}}
    assert res["graph_65_commands"] == {"updates": 2, "median_us": 200, "updated_allocs": {"29": 1, "30": 1}}
    assert summarise(["nothing here"]) == {}
