"""The planner with LoRA: the frozen base keeps only its 16-bit partitions, the adapter's parameters carry the
gradients, fp32 master weights and Adam states, and the activations are those of the full fine-tune."""

from __future__ import annotations

import math

import pytest

from hf_zero3.cli import main
from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.lora import adapter_params
from hf_zero3.plan.memory import plan
from hf_zero3.plan.shapes import load_shape
from hf_zero3.plan.types import Hardware, PlanError, Training
from tests.conftest import ROOT

SPEC = ZeroSpec(stage=3, precision="bf16", activation_checkpointing=True, micro_batch_size=1,
                gradient_accumulation_steps=1, global_batch_size=8)
A100X8 = Hardware(1, 8, 40 * 10**9, 1100 * 10**9)


def test_the_adapter_count_is_peft_s():
    """74,752: what peft reports for r 8 on all-linear of the tiny model (the integration run prints it); 41,943,040:
    peft's count for Llama-3-8B at r 16."""
    assert adapter_params(load_shape(str(ROOT / "assets/tiny/model")), 8) == 74_752
    assert adapter_params(load_shape("8b"), 16) == 41_943_040
    assert adapter_params(load_shape("8b"), 16, ["q_proj", "v_proj"]) == 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    with pytest.raises(PlanError, match="qkv_proj: the planner knows the linear layers q_proj"):
        adapter_params(load_shape("8b"), 16, ["qkv_proj"])


def test_only_the_adapter_has_gradients_and_optimizer_states_and_the_activations_do_not_change():
    shape = load_shape("70b")
    lora = adapter_params(shape, 16)
    full, ours = (plan(shape, A100X8, Training(4096, trainable=t), SPEC) for t in (None, lora))
    bytes_of = {"full": {t.name: t.bytes for t in full.terms}, "ours": {t.name: t.bytes for t in ours.terms}}
    per_gpu = math.ceil(lora / 8)
    assert bytes_of["ours"]["parameters, 16-bit"] == 2 * math.ceil((shape.params + lora) / 8)  # base + adapter
    assert bytes_of["ours"]["gradients, 16-bit"] == 2 * per_gpu
    assert bytes_of["ours"]["fp32 master weights + Adam m, v"] == 12 * per_gpu
    assert bytes_of["ours"]["fp32 gradients"] == 4 * per_gpu
    assert bytes_of["ours"]["16-bit adapter gathered on rank 0 to save"] == 2 * lora
    assert "16-bit model gathered on rank 0 to save" not in bytes_of["ours"]
    for name, value in bytes_of["full"].items():
        if name.startswith(("activations", "logits", "backward working set")):
            assert bytes_of["ours"][name] == value, name
    assert full.gpu_bytes > 140e9 and ours.gpu_bytes < 38e9 and ours.fits  # 70B LoRA: 8 x A100-40GB, no offload
    assert ours.notes[0].startswith("LoRA: 0.21B adapter parameters train, the 68.98B of the base are frozen")


def test_plan_lora_rank_chooses_plain_zero3_where_the_full_fine_tune_needs_offload(capsys):
    assert main(["plan", "--model", "70b", "--hardware", "p4d.24xlarge", "--seq-len", "4096", "--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "choice    ZeRO-3 + checkpointing: micro batch 1" in out
    assert "the final adapter 0.4 GB" in out
    assert main(["plan", "--model", "70b", "--hardware", "p4d.24xlarge", "--seq-len", "4096"]) == 0
    assert "choice    ZeRO-3 + offload optimizer" in capsys.readouterr().out
