"""bench/alternate_summary.py: the constraint's cost per process and over processes."""

from __future__ import annotations

import json

import pytest

from bench.alternate_summary import main, process_costs, summarize


def _write(path, off: list, on: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"constraint": "off", "metrics": {"output_throughput": x}} for x in off]
    rows += [{"constraint": "on", "metrics": {"output_throughput": x}} for x in on]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_costs_per_process_and_over_processes(tmp_path, capsys):
    _write(tmp_path / "a" / "serve_grammar_alternate_c32_p1.jsonl", [100.0, 102.0], [90.0, 91.0])
    _write(tmp_path / "a" / "serve_grammar_alternate_c32_p2.jsonl", [100.0], [80.0])
    _write(tmp_path / "a" / "serve_grammar_cost_open.jsonl", [1.0], [1.0])  # another stage's: not read
    one = process_costs(str(tmp_path / "a" / "serve_grammar_alternate_c32_p1.jsonl"))
    assert one["off"] == pytest.approx(101.0) and one["on"] == pytest.approx(90.5)
    assert one["cost"] == pytest.approx(90.5 / 101.0 - 1) and one["rounds"] == 2
    rows, total = summarize(str(tmp_path / "a"))
    assert [name for name, _ in rows] == ["serve_grammar_alternate_c32_p1.jsonl", "serve_grammar_alternate_c32_p2.jsonl"]
    assert total["processes"] == 2 and total["min"] == pytest.approx(-0.2)
    assert total["mean"] == pytest.approx((90.5 / 101.0 - 1 - 0.2) / 2)
    assert main([str(tmp_path / "a")]) == 0
    assert "cost over 2 processes" in capsys.readouterr().out


def test_a_file_without_both_sides_or_a_folder_without_files_is_an_error(tmp_path):
    _write(tmp_path / "serve_grammar_alternate_c1.jsonl", [100.0], [])
    with pytest.raises(ValueError, match="no alternated runs"):
        process_costs(str(tmp_path / "serve_grammar_alternate_c1.jsonl"))
    with pytest.raises(FileNotFoundError, match="no serve_grammar_alternate"):
        summarize(str(tmp_path / "empty"))
