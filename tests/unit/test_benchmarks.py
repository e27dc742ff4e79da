"""Figures in benchmarks/README.md come from the committed raw records, not from hand-typing."""

from __future__ import annotations

import importlib.util

from tests.conftest import ROOT


def test_planner_table_in_benchmarks_readme_is_regenerated_from_the_records():
    spec = importlib.util.spec_from_file_location("planner_vs_measured", ROOT / "benchmarks/planner_vs_measured.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.table() in (ROOT / "benchmarks/README.md").read_text(), \
        "run `python benchmarks/planner_vs_measured.py` and paste the table into benchmarks/README.md"


def test_summary_rows_in_benchmarks_readme_match_the_generated_reports():
    """Each summary row's tokens/s, MFU and peak memory are those of a row in a committed report."""
    import re

    reports = "".join(p.read_text() for p in (ROOT / "benchmarks").glob("*_*.md"))
    summary = (ROOT / "benchmarks/README.md").read_text().split("## Planner")[0]
    rows = re.findall(r"\| (\d{4}) \| (\d+\.\d)% \| (\d+\.\d) \|", summary)
    assert len(rows) >= 8
    measured = re.findall(r"\| (\d+) \| [\d.]+ \| ([\d.]+)% \| ([\d.]+) \|", reports)
    for tokens, mfu, peak in rows:
        assert any(t == tokens and m == mfu and abs(float(p) - float(peak)) <= 0.05 for t, m, p in measured), \
            (tokens, mfu, peak)
