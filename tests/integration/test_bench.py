"""`hf-zero3 bench` on CPU: ours and the stock template, one after the other, into one report."""

from __future__ import annotations

import json

import pytest

from tests.conftest import explain, run

pytestmark = pytest.mark.integration


def test_bench_tiny_against_stock_writes_report_jsonl_and_png(tmp_path):
    out, work = tmp_path / "benchmarks", tmp_path / "work"
    proc = run(["python", "-m", "hf_zero3", "bench", "tiny", "--steps", "4", "--warmup", "1", "--against", "stock",
                "--out", out, "--work-dir", work, "--", "--per_device_train_batch_size", "4"])
    assert proc.returncode == 0, explain(proc)
    [report] = out.glob("tiny_cpu*_*.md")
    text = report.read_text()
    assert "| ours |" in text and "| stock |" in text and "ours / stock:" in text
    assert "torch " in text and "deepspeed " in text and "Command:" in text and "hf-zero3 bench tiny" in text
    assert '"gradient_checkpointing": true' in text  # stock runs with activation checkpointing, as documented
    records = [json.loads(line) for line in report.with_suffix(".jsonl").read_text().splitlines()]
    for variant in ("ours", "stock"):
        steps = [r for r in records if r["variant"] == variant and "loss" in r]
        assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
        assert all(r["tokens_per_s_per_gpu"] > 0 for r in steps)
    png = report.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_recipe_and_baseline(tmp_path):
    proc = run(["python", "-m", "hf_zero3", "bench", "no-such-recipe", "--out", tmp_path])
    assert proc.returncode == 2 and "is not a recipe folder" in proc.stderr and "tiny" in proc.stderr
    proc = run(["python", "-m", "hf_zero3", "bench", "tiny", "--against", "stock,megatron", "--out", tmp_path])
    assert proc.returncode == 2 and "unknown baseline(s) ['megatron']" in proc.stderr
