"""The one-command GPU scripts of the speed study, in their CPU dry mode (DRY=1: the tiny model, the same plumbing),
so that a GPU lease is not spent on a typo: gpu_speed_7b.sh split over two calls of a time-limited machine (the second
on a fresh work folder, continuing from the first call's OUT), and gpu_profile_7b.sh's table."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, explain, run

pytestmark = pytest.mark.integration


def test_the_speed_study_splits_over_calls_and_continues_on_a_fresh_machine(tmp_path):
    common = {"DRY": "1", "VARIANTS": "ours,rc", "REPEATS": "1"}
    first = run(["bash", ROOT / "benchmarks/gpu_speed_7b.sh", tmp_path / "out1"], timeout=1200,
                WORK=str(tmp_path / "work1"), BENCH_BUDGET_S="1", **common)
    assert first.returncode == 0, explain(first)
    assert "ours run 1: exit 0" in first.stdout and "rc run 1" not in first.stdout
    assert "bench: 1 run(s) left for the time budget" in first.stdout
    assert (tmp_path / "out1" / "speed-tiny_bench_state.json").is_file()

    second = run(["bash", ROOT / "benchmarks/gpu_speed_7b.sh", tmp_path / "out2"], timeout=1200,
                 WORK=str(tmp_path / "work2"), PREV=str(tmp_path / "out1"), **common)
    assert second.returncode == 0, explain(second)
    assert "continuing from" in second.stdout and "ours run 1" not in second.stdout
    assert "rc run 1: exit 0" in second.stdout
    assert "bench: all runs done" in second.stdout
    [report] = (tmp_path / "out2").glob("speed-tiny_*_proof.md")
    text = report.read_text()
    assert "| ours | " in text and "| rc | " in text and "ours / rc: " in text, text
    state = json.loads((tmp_path / "out2" / "speed-tiny_bench_state.json").read_text())
    assert len(state["commands"]) == 2 and set(state["runs"]) == {"ours", "rc"}
    rc = state["runs"]["rc"]["1"]["config"]["training"]
    assert rc["regional_compile"] is True and rc["regional_compile_backend"] == "aot_eager"
    assert "hf_zero3: regional compile on: 4 LlamaDecoderLayer blocks" in (tmp_path / "work2/speed-tiny/runs/rc.log").read_text()


def test_the_profile_of_one_step_says_where_the_time_goes(tmp_path):
    proc = run(["bash", ROOT / "benchmarks/gpu_profile_7b.sh", tmp_path / "out"], timeout=900, DRY="1",
               WORK=str(tmp_path / "work"), PROFILE_STEP="2")
    assert proc.returncode == 0, explain(proc)
    text = (tmp_path / "out" / "profile_7b.txt").read_text()
    assert "one optimizer step (step 2)" in text and "step wall time" in text
    assert "matmul" in text and "attention" in text and "top 15 by time" in text
    assert json.loads((tmp_path / "out" / "profile_7b_plan.json").read_text())["how"].startswith("the planner's choice")
