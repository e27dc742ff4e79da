"""`hf-zero3 compare`'s ladder and arithmetic: each rung is the configuration it is named after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_zero3.ops.compare import (
    DEFAULT_RUNGS,
    RUNGS,
    deviation,
    ds_config_of,
    ladder,
    nvme_skip_reason,
    rung_overrides,
)
from tests.conftest import error_naming


def test_each_rung_builds_the_config_it_is_named_after():
    rungs = {r.name: r for r in ladder(list(RUNGS), on_gpu=True, nvme_path="/nvme")}
    assert list(rungs) == list(RUNGS) and "ddp_seed2" not in DEFAULT_RUNGS
    assert rungs["ddp"].spec is None and ds_config_of(rungs["ddp"], on_gpu=True) is None
    stages = {n: ds_config_of(r, on_gpu=True)["zero_optimization"]["stage"] for n, r in rungs.items() if r.spec}
    assert stages == {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_ckpt": 3, "zero3_ckpt_offload_opt": 3,
                      "zero3_ckpt_offload_all": 3, "zero3_ckpt_nvme": 3, "zero3_rc": 3, "zero3_fp8": 3}
    zero = {n: ds_config_of(r, on_gpu=True)["zero_optimization"] for n, r in rungs.items() if r.spec}
    assert "offload_optimizer" not in zero["zero3_ckpt"] and "offload_param" not in zero["zero3_ckpt"]
    assert zero["zero3_ckpt_offload_opt"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero["zero3_ckpt_offload_opt"]
    assert zero["zero3_ckpt_offload_all"]["offload_param"]["device"] == "cpu"
    assert zero["zero3_ckpt_nvme"]["offload_param"]["nvme_path"] == "/nvme"
    assert zero["zero3_ckpt_nvme"]["offload_optimizer"]["nvme_path"] == "/nvme"


def test_overrides_set_checkpointing_and_deepspeed_whatever_the_recipe_says():
    rungs = {r.name: r for r in ladder(list(RUNGS), on_gpu=False, nvme_path=None)}
    assert rung_overrides(rungs["ddp"], 42) == ["--gradient_checkpointing", "false", "--deepspeed", "null"]
    assert rung_overrides(rungs["ddp_seed2"], 42)[-2:] == ["--data_seed", "43"]
    assert rung_overrides(rungs["zero3"], 42) == ["--gradient_checkpointing", "false"]
    assert rung_overrides(rungs["zero3_fp8"], 42) == [
        "--gradient_checkpointing", "false", "--regional_compile", "true", "--regional_compile_backend", "aot_eager",
        "--fp8", "true"]
    assert rung_overrides(rungs["zero3_rc"], 42)[-1] == "aot_eager"
    gpu = {r.name: r for r in ladder(["zero3_fp8"], on_gpu=True, nvme_path=None)}
    assert "inductor" in gpu["zero3_fp8"].train
    ckpt = rung_overrides(rungs["zero3_ckpt_offload_all"], 42)
    assert ckpt[:2] == ["--gradient_checkpointing", "true"] and json.loads(ckpt[3]) == {"use_reentrant": False}
    # on CPU the offloaded optimizer is torch's AdamW in host buffers that are not pinned
    config = ds_config_of(rungs["zero3_ckpt_offload_opt"], on_gpu=False)
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["zero_optimization"]["offload_optimizer"]["pin_memory"] is False


def test_unknown_rung_is_named():
    with pytest.raises(ValueError, match="unknown rung.*zero4.*choose from ddp"):
        ladder(["ddp", "zero4"], on_gpu=False, nvme_path=None)


def test_deviation_from_the_reference():
    ref = [{"step": s, "loss": 5.0 - s} for s in range(1, 11)] + [{"step": 10, "eval_loss": 4.0}]
    ours = [{"step": s, "loss": 5.0 - s + (0.5 if s == 3 else 0.01)} for s in range(1, 11)]
    d = deviation(ours, ref)
    assert d["max"] == pytest.approx(0.5) and d["final"] == pytest.approx(0.01) and d["steps"] == 10
    assert d["tail_mean"] == pytest.approx(0.01)
    assert deviation(ours, []) is None


def test_nvme_rung_needs_a_path():
    assert "--nvme-path" in nvme_skip_reason(None)


def test_report_gives_memory_and_speed_against_ddp_and_names_skips():
    from hf_zero3.ops.compare import render_report

    meta = {"label": "x", "overrides": ["--bf16", "true"], "init_sha256": "a" * 64}
    summaries = {
        "ddp": {**meta, "gpu_peak_allocated_gib": 40.0, "gpu_peak_reserved_gib": 44.0, "tokens_per_s_per_gpu": 1000.0},
        "zero3": {**meta, "gpu_peak_allocated_gib": 12.0, "gpu_peak_reserved_gib": 14.0, "tokens_per_s_per_gpu": 800.0},
        "zero3_ckpt_nvme": {**meta, "skipped": "no libaio"},
    }
    records = {"ddp": [{"step": 1, "loss": 5.0}], "zero3": [{"step": 1, "loss": 5.25}], "zero3_ckpt_nvme": []}
    text = render_report(summaries, records)
    row = next(line for line in text.splitlines() if line.startswith("| zero3 |"))
    assert "-70%" in row and "0.80x" in row and "2.5e-01" in row
    assert "| zero3_ckpt_nvme | skipped: no libaio |" in text
    assert "Precision: DDP is the Trainer's bf16 autocast" in text and "Warning" not in text
    summaries["zero3"]["init_sha256"] = "b" * 64
    assert "did not all start from the same initial weights" in render_report(summaries, records)


def test_a_rung_with_fewer_steps_says_so_and_its_deviation_covers_only_those():
    """The NVMe rung runs --nvme-steps (a slow disk cannot do 500): its row names its step count."""
    from hf_zero3.ops.compare import render_report

    meta = {"label": "x", "init_sha256": "a" * 64}
    summaries = {"ddp": {**meta, "steps": 3, "gpu_peak_allocated_gib": 40.0, "tokens_per_s_per_gpu": 1000.0},
                 "zero3_ckpt_nvme": {**meta, "steps": 1, "gpu_peak_allocated_gib": 8.0, "tokens_per_s_per_gpu": 50.0}}
    records = {"ddp": [{"step": s, "loss": 5.0} for s in (1, 2, 3)], "zero3_ckpt_nvme": [{"step": 1, "loss": 5.5}]}
    row = next(line for line in render_report(summaries, records).splitlines() if "zero3_ckpt_nvme" in line)
    assert row.startswith("| zero3_ckpt_nvme (1 steps: Δloss over those) |") and "5.0e-01" in row


def test_initial_weights_replace_only_their_own_leftover_staging_folder(tmp_path):
    """The from-scratch weights are written to `<name>.tmp` and renamed; a `.tmp` of that name that a killed earlier
    call left (owner file beside it) is replaced, one that is someone's data stops the compare, untouched."""
    import hashlib

    from transformers import AutoConfig

    from hf_zero3.checkpoint.lifecycle import CheckpointError
    from hf_zero3.ops.compare import initial_weights

    root = Path(__file__).resolve().parents[2]
    values = {"config_name": str(root / "assets/tiny/model"), "tokenizer_name": str(root / "assets/tiny/model")}
    key = hashlib.sha256(f"{AutoConfig.from_pretrained(values['config_name']).to_json_string()}42".encode()).hexdigest()
    tmp = tmp_path / f"initial_model_{key[:12]}.tmp"
    tmp.mkdir()
    (tmp / "my_notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="was not left by hf-zero3"):
        initial_weights(values, tmp_path, 42)
    assert (tmp / "my_notes.txt").read_text() == "mine"

    (tmp_path / f"{tmp.name}.owner").write_text("ours")  # as a killed earlier call leaves it
    folder, digest = initial_weights(values, tmp_path, 42)
    assert Path(folder) == tmp.with_name(tmp.stem) and (Path(folder) / "model.safetensors").is_file()
    assert not tmp.exists() and not (tmp_path / f"{tmp.name}.owner").exists() and len(digest) == 64


def test_a_rung_stopped_partway_shows_its_steps_against_the_same_steps_of_the_seed_spread():
    """`--stop-after` or `--run-timeout` (exit 124) leaves the first steps of the full schedule: the row shows their
    figures, and the DDP seed spread is taken over those steps, not over the whole run."""
    from hf_zero3.ops.compare import render_report

    meta = {"label": "x", "init_sha256": "a" * 64}
    full = {"steps": 10, "schedule_steps": 10, "gpu_peak_allocated_gib": 40.0, "tokens_per_s_per_gpu": 1000.0}
    summaries = {"ddp": {**meta, **full}, "ddp_seed2": {**meta, **full},
                 "zero3": {**meta, **full, "steps": 4, "gpu_peak_allocated_gib": 38.0},
                 "zero3_ckpt_offload_opt": {**meta, "steps": 2, "gpu_peak_allocated_gib": 4.0,
                                            "tokens_per_s_per_gpu": 100.0, "command": "torchrun x --max_steps 10",
                                            "error": "exit 124: stopped by --run-timeout (9 s)"},
                 "zero3_ckpt": {**meta, "steps": 0, "schedule_steps": 10, "error": "exit 1: error: CUDA OOM"}}
    records = {"ddp": [{"step": s, "loss": 5.0} for s in range(1, 11)],
               "ddp_seed2": [{"step": s, "loss": 5.0 + (0.5 if s > 4 else 0.1)} for s in range(1, 11)],
               "zero3": [{"step": s, "loss": 5.0 + 0.01 * s} for s in range(1, 5)],
               "zero3_ckpt_offload_opt": [{"step": s, "loss": 5.0 + 0.01 * s + 0.002} for s in (1, 2)],
               "zero3_ckpt": []}
    lines = render_report(summaries, records).splitlines()
    row = next(line for line in lines if line.startswith("| zero3 ("))
    cells = [c.strip() for c in row.split("|")]
    assert "first 4 of the 10-step schedule" in cells[1] and cells[2] == "38.00", row
    assert "| 4.0e-02 | 4.0e-02 | 4.0e-02 | 1.0e-01 |" in row  # its own Δ, then the seed spread over steps 1-4
    opt = next(line for line in lines if line.startswith("| zero3_ckpt_offload_opt"))
    cells = [c.strip() for c in opt.split("|")]
    assert "first 2 of the 10-step schedule" in cells[1] and "exit 124" in cells[1] and cells[2] == "4.00", opt
    assert "-90%" in opt and "0.10x" in opt
    assert any(line.startswith("| zero3_ckpt | failed: exit 1: error: CUDA OOM |") for line in lines)
    against = next(line for line in lines if line.startswith("Against zero3"))
    error_naming(against, "zero3_ckpt_offload_opt", "max 2.0e-03", "final 2.0e-03", "2 steps")
