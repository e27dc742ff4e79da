"""The planner's advice after an out-of-memory error: the cheapest step that gives up memory on every axis, as
exact overrides, for GPU memory and host RAM, and from what a run's train.py holds."""

from __future__ import annotations

import pytest
import torch

from hf_zero3.config.build import build_ds_config
from hf_zero3.config.presets import STANDALONE_CONFIGS
from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.advice import oom_advice
from hf_zero3.plan.shapes import load_shape
from hf_zero3.plan.types import Training
from hf_zero3.run import oom
from hf_zero3.run.oom import oom_advice_for_run, oom_kind
from hf_zero3.units import GB
from tests.conftest import error_naming
from tests.unit.test_planner import STOCK, _gpus

S7, S70 = load_shape("7b"), load_shape("70b")


def test_oom_advice_takes_the_cheapest_more_frugal_step():
    advice = oom_advice(S7, _gpus(), Training(4096, 1, 8, trainer=STOCK), ZeroSpec(stage=3))
    assert advice.endswith("--gradient_checkpointing true")
    error_naming(advice.splitlines()[-1], "Next step", "24.4 GB", "ZeRO-3 + checkpointing, micro batch 1")
    # at 4096 tokens the peak is the optimizer step (fp32 gradients + their 16-bit source), which activation offload
    # cannot lower: the next step is the optimizer's offload; at 8192 the checkpointed activations set the peak
    advice = oom_advice(S7, _gpus(), Training(4096, 1, 8, trainer=STOCK),
                        ZeroSpec(stage=3, activation_checkpointing=True))
    error_naming(advice, "Next step", "10.8 GB", "ZeRO-3 + offload optimizer (cpu) + checkpointing, micro batch 1")
    advice = oom_advice(S7, _gpus(), Training(8192, 1, 8, trainer=STOCK),
                        ZeroSpec(stage=3, activation_checkpointing=True))
    assert advice.endswith("--activation_offload true")
    error_naming(advice.splitlines()[-1], "Next step", "25.1 GB", "activation offload, micro batch 1")
    advice = oom_advice(S7, _gpus(), Training(4096, 1, 8, trainer=STOCK),
                        ZeroSpec(stage=3, activation_checkpointing=True, activation_offload=True))
    assert "`hf-zero3 config new --precision bf16 --stage 3 --offload-optimizer cpu -o ds_config.planned.json`" \
           in advice
    s8 = load_shape("8b")
    advice = oom_advice(s8, _gpus(mem=80 * GB), Training(8192, 8, 1, trainer=STOCK),
                        ZeroSpec(stage=2, activation_checkpointing=True))
    error_naming(advice.splitlines()[-1], "--per_device_train_batch_size 1", "--gradient_accumulation_steps 8",
                 "same global batch")


def test_oom_advice_for_host_memory_moves_to_nvme():
    spec = STANDALONE_CONFIGS["zero3_offload_optimizer"].model_copy(update={"activation_checkpointing": True})
    hw = _gpus(host=1000 * GB, nvme_path="/nvme", nvme_free=4000 * GB)
    advice = oom_advice(S70, hw, Training(4096), spec, host=True, ds_config_path="my_ds.json")
    assert "out of host RAM" in advice
    assert "`hf-zero3 config new --like my_ds.json --stage 3 --offload-optimizer nvme --nvme-path /nvme" in advice
    no_nvme = oom_advice(S70, _gpus(host=1000 * GB), Training(4096), spec, host=True)
    assert "No more frugal option is predicted to fit" in no_nvme and "2 nodes" in no_nvme


def test_oom_kind():
    assert oom_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "cuda"
    assert oom_kind(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                                 "you tried to allocate 1099511627776 bytes")) == "host"
    assert oom_kind(ValueError("shapes do not match")) is None


def test_oom_advice_for_run_reads_what_train_py_holds(monkeypatch):
    from types import SimpleNamespace

    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000)
    ds = SimpleNamespace(config=build_ds_config(ZeroSpec(stage=3)))
    args = SimpleNamespace(hf_deepspeed_config=ds, deepspeed="ds.json", bf16=True, fp16=False,
                           gradient_checkpointing=False, world_size=8, per_device_train_batch_size=1,
                           gradient_accumulation_steps=8)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    seen = {}

    def fake_detect(**kwargs):
        seen.update(kwargs)
        return _gpus(kwargs["nodes"], kwargs["gpus_per_node"])

    monkeypatch.setattr(oom, "detect_hardware", fake_detect)
    advice = oom_advice_for_run(config, args, 4096)
    assert (seen["nodes"], seen["gpus_per_node"]) == (1, 8)
    assert advice.endswith("--gradient_checkpointing true")


@pytest.mark.parametrize("setting", [False, None, True])
def test_the_oom_advice_plans_the_activation_offload_the_run_runs(setting):
    """A ds_config asking for cpu_checkpointing with `activation_offload: false`: the run keeps activations on the GPU
    (false wins), and so does the plan the advice starts from (it used to let the ds_config win)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from hf_zero3.job.facts import activation_offload_of

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000)
    ds = build_ds_config(ZeroSpec(stage=3, activation_checkpointing=True, activation_offload=True))
    assert ds["activation_checkpointing"] == {"cpu_checkpointing": True}
    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=ds), deepspeed="ds.json", bf16=True,
                           fp16=False, gradient_checkpointing=True, world_size=8, per_device_train_batch_size=1,
                           gradient_accumulation_steps=8, activation_offload=setting)
    runs = activation_offload_of(setting, ds)  # what train's _maybe_offload_activations decides
    assert runs is (setting is not False)
    advice = oom_advice_for_run(config, args, 4096, hardware=_gpus(1, 8))
    planned = advice.split("Planned for this run: ")[1].split(", micro batch")[0]
    assert ("activation offload" in planned) is runs, advice
