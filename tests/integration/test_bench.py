"""`hf-zero3 bench` on CPU: ours and the stock template, one after the other, into one report."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, error_naming, explain, run, subprocess_env

pytestmark = pytest.mark.integration

STALL_S = 600
"""A bench that writes nothing for this long is stuck. Its total time has no limit: two 2-rank DeepSpeed starts
(and, on a fresh machine, DeepSpeed's CPU all-reduce op compiling) take minutes on a loaded machine, and a
fixed limit stopped the bench halfway, leaving a report with only the first variant's rows."""


def _newest_change(folder: Path) -> float:
    newest = folder.stat().st_mtime
    for path in folder.rglob("*"):
        try:
            newest = max(newest, path.stat().st_mtime)
        except FileNotFoundError:  # the bench clears a variant's run folder as it starts it
            pass
    return newest


def bench(*args, folder: Path) -> subprocess.CompletedProcess:
    """`hf-zero3 bench ARGS` writing under `folder`; stopped (SIGTERM: the bench then stops its ranks) only when
    nothing under `folder` has changed for STALL_S."""
    cmd = [str(a) for a in ("python", "-m", "hf_zero3", "bench", *args)]
    log = folder / "bench.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(2)
            if time.time() - _newest_change(folder) > STALL_S:
                proc.terminate()
                proc.wait(120)
                pytest.fail(f"bench stuck: nothing written for {STALL_S} s\n{log.read_text()[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), "")


def test_bench_tiny_against_stock_writes_report_jsonl_and_png(tmp_path):
    out, work = tmp_path / "benchmarks", tmp_path / "work"
    proc = bench("tiny", "--steps", "4", "--warmup", "1", "--against", "stock", "--out", out, "--work-dir", work,
                 "--", "--per_device_train_batch_size", "4", folder=tmp_path)
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
    progress = [line for line in proc.stdout.splitlines() if line.startswith("[1/2] ours run 1: step")]
    assert progress and progress[-1].startswith("[1/2] ours run 1: step 5/5, ") and " s, ETA " in progress[-1], \
        proc.stdout[-3000:]  # off a terminal (its output goes to a file): lines with the ETA, not a bar


def test_a_failed_variant_fails_the_bench_and_is_named(tmp_path):
    """block_size above the model's positions: every variant's rank refuses it; the bench names each with train's
    own error line and exits 1. A tuned baseline's search stops at a failure that is not out-of-memory (no smaller
    micro batch is tried) and the report lists it among the baseline runs that failed."""
    out = tmp_path / "benchmarks"
    proc = bench("tiny", "--gpus", "1", "--steps", "1", "--warmup", "0", "--against", "stock_tuned", "--tuned",
                 "stock_tuned=2", "--out", out, "--work-dir", tmp_path / "work", "--", "--block_size", "100000",
                 folder=tmp_path)
    assert proc.returncode == 1, explain(proc)
    for variant in ("ours", "stock_tuned_2"):
        error_naming(proc.stdout, f"variant {variant} failed", "block_size=100000", "max positions (512)")
    assert "stock_tuned_1 run" not in proc.stdout
    [report] = out.glob("tiny_cpu*_*.md")
    text = report.read_text()
    assert "| ours | failed: exit 2: error: block_size=100000" in text and "No baseline ran" in text
    failed = text.split("Baseline runs that failed (counted as results, not dropped): ")[1].splitlines()[0]
    assert failed.startswith("stock_tuned_2 (exit 2: error: block_size=100000"), failed


def _second_rank(process: psutil.Process) -> bool:
    try:
        return "--local_rank=1" in process.cmdline()
    except psutil.Error:  # gone meanwhile
        return False


def test_a_stopped_bench_stops_its_ranks(tmp_path):
    """SIGTERM to the bench: no rank goes on running (DeepSpeed's launcher alone would leave them)."""
    with (tmp_path / "bench.log").open("w") as log:
        proc = subprocess.Popen(["python", "-m", "hf_zero3", "bench", "tiny", "--steps", "50", "--out",
                                 str(tmp_path / "benchmarks"), "--work-dir", str(tmp_path / "work")],
                                cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    bench_process, tree = psutil.Process(proc.pid), []
    try:
        deadline = time.time() + STALL_S
        while proc.poll() is None and time.time() < deadline:
            tree = bench_process.children(recursive=True)
            if any(map(_second_rank, tree)):
                break
            time.sleep(1)
        assert any(map(_second_rank, tree)), (tmp_path / "bench.log").read_text()[-4000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        for process in [bench_process, *tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def test_bench_tuned_baselines_on_one_rank(tmp_path):
    """The competent user's baselines on one rank (ZeRO-3, ZeRO-2, FSDP2, the plain Trainer) train the recipe's global
    batch at the micro batch their search found, with Liger asked for and the Trainer's fused AdamW; the report names
    the best. (Resumed calls and the time budget: tests/unit/test_bench_variants.py, on recorded runs.)"""
    out, work = tmp_path / "benchmarks", tmp_path / "work"
    common = ["--gpus", "1", "--steps", "2", "--warmup", "1", "--suffix", "tuned", "--out", out, "--work-dir", work,
              "--", "--per_device_train_batch_size", "4", "--use_liger_kernel", "true"]
    tuned = ["--against", "tuned", "--tuned", "stock_tuned=2", "--tuned", "zero2_tuned=3+ckpt",
             "--tuned", "fsdp2_tuned=2", "--tuned", "plain_tuned=4+ckpt"]
    proc = run(["python", "-m", "hf_zero3", "bench", "tiny", *tuned, *common])
    assert proc.returncode == 0, explain(proc)
    [report] = out.glob("tiny_cpu*_*_tuned.md")
    text = report.read_text()
    names = ("ours", "stock_tuned_2", "zero2_tuned_2_ckpt", "fsdp2_tuned_2", "plain_tuned_4_ckpt")
    assert all(f"| {name} | " in text for name in names), text
    assert "zero2_tuned_3" not in text  # 3 does not divide the per-rank batch of 4: the search starts at 2
    assert "**The best baseline: " in text and "; ours / it: **" in text
    configs = {name: json.loads((work / name / "run_config.json").read_text()) for name in names}
    batch = {n: (c["training"]["per_device_train_batch_size"], c["training"]["gradient_accumulation_steps"])
             for n, c in configs.items()}
    assert batch == {"ours": (4, 1), "stock_tuned_2": (2, 2), "zero2_tuned_2_ckpt": (2, 2), "fsdp2_tuned_2": (2, 2),
                     "plain_tuned_4_ckpt": (4, 1)}  # 4 sequences a step each
    assert configs["stock_tuned_2"]["ds_config"]["zero_optimization"]["stage"] == 3
    assert configs["zero2_tuned_2_ckpt"]["ds_config"]["zero_optimization"]["stage"] == 2
    assert "optimizer" not in configs["stock_tuned_2"]["ds_config"]
    assert configs["fsdp2_tuned_2"]["ds_config"] is None and configs["fsdp2_tuned_2"]["training"]["fsdp_config"]
    assert configs["plain_tuned_4_ckpt"]["ds_config"] is None and not configs["plain_tuned_4_ckpt"]["training"]["fsdp"]
    assert [n for n, c in configs.items() if c["training"]["gradient_checkpointing"]] == [
        "zero2_tuned_2_ckpt", "plain_tuned_4_ckpt"]
    assert all(c["training"]["optim"] == "adamw_torch_fused" for n, c in configs.items() if n != "ours")
    for name in names:  # asked for by every variant; a CPU has no Triton kernels, so train turns it off and says so
        assert "hf_zero3: use_liger_kernel needs a GPU: off on CPU" in (work / f"{name}.log").read_text(), name
    assert not list(work.glob("*/model*.safetensors"))  # bench runs skip the final save

