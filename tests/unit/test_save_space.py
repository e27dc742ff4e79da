"""The size of a save, estimated before the first one, and the guard's check of the disk when training starts."""

from __future__ import annotations

import json

import pytest
import torch

from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.plan.saves import SaveSize, moment_bytes, save_size
from tests.conftest import error_naming

ZERO3_SHARDS = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
ZERO2 = {"zero_optimization": {"stage": 2}}


def test_zero3_sizes_match_what_deepspeed_and_the_trainer_write():
    """12 B per parameter of fp32 weights and Adam moments (the tiny recipe's 2-rank ZeRO-3 fp32 checkpoint:
    2 x 6,008,831 B of optimizer states for 1,001,600 parameters, 4,006,432 B of weights)."""
    checkpoint, final = save_size(1_001_600, 4, ZERO3, "adamw_torch_fused", gathered=True)
    assert checkpoint == SaveSize(12_019_200, 4_006_400) and final == SaveSize(0, 4_006_400)
    assert abs(checkpoint.total - (2 * 6_008_831 + 4_006_432)) / checkpoint.total < 0.01


def test_zero3_without_gathering_saves_shards_for_the_final_model_too():
    """Recipe 10b-h200x1: 10.73B parameters, bf16, ZeRO shards: 129 GB for every save (more than its box's disk)."""
    checkpoint, final = save_size(10_731_524_096, 2, ZERO3_SHARDS, "AdamW", gathered=False)
    assert checkpoint == final == SaveSize(128_778_289_152, 0)


def test_below_zero3_rank0_also_saves_the_module_and_without_deepspeed_the_optimizer_file():
    checkpoint, final = save_size(1000, 2, ZERO2, "AdamW", gathered=True)
    assert checkpoint == SaveSize(12_000, 4_000) and final == SaveSize(0, 2_000)
    checkpoint, final = save_size(1000, 4, None, "adamw_torch", gathered=True)
    assert checkpoint == SaveSize(0, 12_000) and final == SaveSize(0, 4_000)


@pytest.mark.parametrize("name, moments", [("AdamW", 8), ("adamw_torch_fused", 8), ("Lamb", 8),
                                           ("adamw_bnb_8bit", 2), ("sgd", 0), ("adafactor", 0)])
def test_optimizer_moments_are_a_lower_bound(name, moments):
    assert moment_bytes(name) == moments


def test_a_node_gets_its_ranks_share_and_rank0s_node_the_whole_model_files():
    size = SaveSize(sharded=800, whole=100)
    assert size.on_node(local_ranks=8, world_size=8, has_rank0=True) == 900
    assert size.on_node(local_ranks=4, world_size=8, has_rank0=False) == 400


def _begin(tmp_path, model, **kw):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_zero3.callbacks import CheckpointGuardCallback

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)
    state = TrainerState()
    state.max_steps, state.save_steps = 100, 10
    guard = CheckpointGuardCallback(save_total_limit=2)
    try:
        guard.on_train_begin(args, state, TrainerControl(), model=model)
    finally:
        guard.on_train_end(args, state, TrainerControl())
    return guard


def _free(monkeypatch, tmp_path, free: int) -> None:
    import shutil

    total = shutil.disk_usage(tmp_path).total
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(total, total - free, free))


def test_a_disk_that_cannot_hold_the_first_save_stops_the_run_before_its_first_step(tmp_path, monkeypatch):
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 fp32 parameters: 4 MB of weights + 8 MB of moments
    _free(monkeypatch, tmp_path, 5_000_000)
    with pytest.raises(ckpt.CheckpointError) as raised:
        _begin(tmp_path, model, save_strategy="steps", save_steps=10)
    error_naming(str(raised.value), f"the disk of {tmp_path}", "GB free", "the first checkpoint", "larger disk")
    assert not list(ckpt.list_checkpoints(tmp_path))
    _begin(tmp_path, model, save_strategy="no")  # only the final model: 4 MB of weights, 5 MB free
    _free(monkeypatch, tmp_path, 3_000_000)
    with pytest.raises(ckpt.CheckpointError, match="but the final model of this model takes about"):
        _begin(tmp_path, model, save_strategy="no")


def test_the_first_save_is_checked_against_the_estimate_and_later_ones_against_the_newest(tmp_path, monkeypatch,
                                                                                          capsys):
    model = torch.nn.Linear(1000, 1000)
    _free(monkeypatch, tmp_path, 20_000_000)
    guard = _begin(tmp_path, model, save_strategy="steps", save_steps=10)
    assert guard._first_save_bytes == 12_012_000
    out = capsys.readouterr().out
    assert "warning: the disk of" in out and "writes 3 more checkpoint(s) of about 12.0 MB" in out
    assert "save_total_limit=2" in out and "Lower save_total_limit" in out
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state, control = TrainerState(), TrainerControl(should_save=True)
    state.global_step = 10
    guard.space_margin = 2.0  # 24 MB wanted, 20 MB free: the estimate decides while no checkpoint is complete
    with pytest.raises(ckpt.CheckpointError, match="disk full: checkpoint-10 needs about 0.024 GB"):
        guard.on_step_end(args, state, control)


def test_a_roomy_disk_passes_silently(tmp_path, capsys):
    guard = _begin(tmp_path, torch.nn.Linear(10, 10), save_strategy="steps", save_steps=10)
    out = capsys.readouterr().out
    assert guard._first_save_bytes == 110 * 12 and "warning" not in out
    error_naming(out, "a checkpoint of this model", "0.0 MB", "the final model", "free under")


def test_save_best_flags_its_save_when_the_metric_improves_and_drops_an_unused_flag(tmp_path):
    """save_strategy "best": the Trainer decides after evaluating, so the guard flags the save in on_evaluate
    (a kill mid-save then leaves a folder resume auto can clean up, instead of a "foreign" one)."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_zero3.callbacks import CheckpointGuardCallback

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], eval_strategy="steps",
                             eval_steps=5, save_strategy="best")
    state, control = TrainerState(), TrainerControl()
    guard = CheckpointGuardCallback()
    guard.on_train_begin(args, state, control)
    try:
        state.global_step = 5
        guard.on_evaluate(args, state, control, metrics={"eval_loss": 2.0})
        assert (tmp_path / "checkpoint-5" / ckpt.SAVING).is_file()
        state.best_metric, state.global_step = 2.0, 10
        guard.on_step_begin(args, state, control)  # as if the Trainer had not saved: the flag-only folder goes
        assert not (tmp_path / "checkpoint-5").exists()
        guard.on_evaluate(args, state, control, metrics={"eval_loss": 2.5})  # worse: no save, no flag
        guard.on_evaluate(args, state, control, metrics={"eval_loss": float("nan")})
        assert not (tmp_path / "checkpoint-10").exists()
    finally:
        guard.on_train_end(args, state, control)
    guard.on_evaluate(args, state, control, metrics={"eval_loss": 1.0})  # the evaluation after training
    assert not (tmp_path / "checkpoint-10").exists()


@pytest.mark.parametrize("variable", ["LOCAL_SIZE", "LOCAL_WORLD_SIZE"])
def test_the_disk_check_counts_the_ranks_the_launcher_puts_on_this_node(tmp_path, monkeypatch, variable):
    """DeepSpeed's launcher says LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE: 2 of 4 ranks on this node write half the
    shards here (the guard used to read only LOCAL_WORLD_SIZE and count all 4 ranks under DeepSpeed's launcher)."""
    from types import SimpleNamespace

    from transformers import TrainerState

    from hf_zero3.callbacks import CheckpointGuardCallback

    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "2")
    args = SimpleNamespace(save_strategy="steps", save_final_model=True, world_size=4, process_index=0,
                           local_process_index=0, output_dir=str(tmp_path))
    state = TrainerState()
    state.max_steps, state.save_steps, state.is_world_process_zero = 100, 10, True
    guard = CheckpointGuardCallback()
    guard._check_space(args, state, SaveSize(sharded=4_000_000, whole=0), SaveSize(sharded=0, whole=1_000))
    assert guard._first_save_bytes == 2_000_000
