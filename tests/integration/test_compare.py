"""`hf-zero3 compare` on CPU, 2 ranks, fp32: the whole ladder trains the same model from the same weights on the
same data, and every rung's loss matches DDP's within 1e-4 at each of 12 steps, with its memory recorded."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from hf_zero3.ops.compare import DEFAULT_RUNGS
from tests.conftest import explain, run

pytestmark = pytest.mark.integration

STEPS = 12


TRAIN = ["--", "--per_device_train_batch_size", "4", "--block_size", "64", "--max_eval_samples", "4",
         "--warmup_steps", "0"]
"""No learning-rate warmup: the cosine decays from step 1, so a rung stopped early shows whether it followed the full
schedule (a 6-step cosine would differ from step 2 on)."""


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """The whole default ladder, once for the module: (out, work, the finished process)."""
    tmp = tmp_path_factory.mktemp("ladder")
    out, work = tmp / "out", tmp / "work"
    proc = run(["python", "-m", "hf_zero3", "compare", "tiny", "--steps", str(STEPS), "--warmup", "2",
                "--nvme-path", tmp / "nvme", "--out", out, "--work-dir", work, *TRAIN], timeout=900)
    return out, work, proc


def test_the_ladder_matches_ddp_and_records_memory(ladder):
    out, _, proc = ladder
    assert proc.returncode == 0, explain(proc)
    summaries = {name: json.loads((out / "rungs" / f"{name}.json").read_text()) for name in DEFAULT_RUNGS}
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        assert "skipped" not in summaries["zero3_ckpt_nvme"]
    else:  # CI has no libaio: the NVMe rung says so instead of failing or vanishing
        assert "libaio" in summaries["zero3_ckpt_nvme"]["skipped"]
    ran = {n: s for n, s in summaries.items() if "skipped" not in s}
    assert set(ran) >= set(DEFAULT_RUNGS) - {"zero3_ckpt_nvme"}
    assert len({s["init_sha256"] for s in ran.values()}) == 1  # one set of initial weights for all

    def losses(name):
        records = [json.loads(line) for line in (out / "rungs" / f"{name}.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), name
        assert all(r["grad_norm"] > 0 and r["host_rss_gib"] > 0 for r in steps), name  # memory at every step
        assert any("eval_loss" in r for r in records), name  # held-out loss at the end
        return [r["loss"] for r in steps]

    reference = losses("ddp")
    assert reference[-1] < reference[0] - 0.5, reference  # it learns: parity of a flat curve would prove little
    for name, summary in ran.items():
        assert summary["host_rss_gib"] > 0 and summary["eval_perplexity"] > 1, (name, summary)
        ours = losses(name)
        worst = max(abs(a - b) for a, b in zip(ours, reference))
        assert worst < 1e-4, (name, worst, list(zip(ours, reference)))
    assert ran["zero3_ckpt"]["command"].count("--gradient_checkpointing true") == 1
    assert ran["ddp"]["ds_config"] is None and "--deepspeed null" in ran["ddp"]["command"]
    assert {n: s["ds_config"]["zero_optimization"]["stage"] for n, s in ran.items() if s["ds_config"]} == {
        n: (1 if n == "zero1" else 2 if n == "zero2" else 3) for n in ran if n != "ddp"}
    report = (out / "seed_claims_tiny.md").read_text()
    assert "CPU run: no GPU memory exists" in report
    for name in DEFAULT_RUNGS:
        assert f"| {name} |" in report
    assert (out / "seed_claims_tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stop_after_runs_the_first_steps_of_the_full_schedule(ladder, tmp_path):
    """`--stop-after 6` of a 12-step schedule: the rung logs 6 steps whose learning rates and losses are DDP's first 6
    of 12 (the ladder's DDP rung, recorded), it counts as run, and the report says so."""
    ladder_out, work, _ = ladder
    out = tmp_path / "out"
    (out / "rungs").mkdir(parents=True)
    for name in ("ddp.json", "ddp.jsonl"):  # DDP's full schedule: recorded, so not run again
        shutil.copy(ladder_out / "rungs" / name, out / "rungs" / name)
    short = run(["python", "-m", "hf_zero3", "compare", "tiny", "--rungs", "zero3", "--stop-after", "6", "--steps",
                 str(STEPS), "--warmup", "2", "--out", out, "--work-dir", work, *TRAIN], timeout=600)
    assert short.returncode == 0, explain(short)
    assert re.search(rf"compare zero3: stopped after \d+ of {STEPS} steps, as asked", short.stderr), short.stderr[-2000:]

    def steps(name):
        return [json.loads(line) for line in (out / "rungs" / f"{name}.jsonl").read_text().splitlines()
                if '"loss"' in line]

    ddp, zero3 = steps("ddp"), steps("zero3")
    assert [r["step"] for r in zero3] == list(range(1, 7))
    assert [r["learning_rate"] for r in zero3] == [r["learning_rate"] for r in ddp[:6]]
    assert ddp[1]["learning_rate"] < ddp[0]["learning_rate"]  # the cosine decays from step 1: the check can fail
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(zero3, ddp)) < 1e-4
    summary = json.loads((out / "rungs" / "zero3.json").read_text())
    assert summary["steps"] == 6 and summary["schedule_steps"] == STEPS and "error" not in summary
    assert f"| zero3 (first 6 of the {STEPS}-step schedule: Δloss over those) |" in (out / "seed_claims_tiny.md").read_text()
