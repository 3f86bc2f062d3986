"""bench/startup.py's profiled construction: the result passes through, the stats and the text
summary land beside each other, and without a path nothing is written."""
import os
import pstats

from bench.startup import profiled


def _work():
    return sum(i * i for i in range(2000))


def test_profiled_returns_the_result_and_writes_stats(tmp_path):
    path = str(tmp_path / "cold")
    assert profiled(_work, path) == _work()
    stats = pstats.Stats(path + ".prof")
    assert any(name == "_work" for (_, _, name) in stats.stats)
    text = open(path + ".txt").read()
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
    assert "_work" in text


def test_profiled_without_a_path_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert profiled(_work, None) == _work()
    assert os.listdir(tmp_path) == []
