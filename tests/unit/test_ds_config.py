"""build_ds_config: the policy in its docstring, round-tripped through DeepSpeed and transformers' bridge."""

from __future__ import annotations

import json
import types
from pathlib import Path
from unittest import mock

import pytest
from pydantic import ValidationError

from hf_zero3.config.build import BRIDGE_FILLED_KEYS, build_ds_config, training_args_overrides
from hf_zero3.config.check import check_ds_config
from hf_zero3.config.presets import RECIPE_CONFIGS, STANDALONE_CONFIGS, generated_files, render, stale_configs
from hf_zero3.config.spec import OptimizerOffload, ParamOffload, ZeroSpec

ROOT = Path(__file__).resolve().parents[2]
ALL_SPECS = {**STANDALONE_CONFIGS, **{f"recipe:{k}": v for k, v in RECIPE_CONFIGS.items()}}


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def _with_nvme(config: dict, path: Path) -> dict:
    config = json.loads(json.dumps(config))
    for which in ("offload_param", "offload_optimizer"):
        block = config.get("zero_optimization", {}).get(which)
        if block and block.get("device") == "nvme":
            block["nvme_path"] = str(path)
    return config


def test_committed_configs_match_the_generator():
    assert stale_configs(ROOT) == [], "run `make configs` and commit the result"
    assert {p.relative_to(ROOT).as_posix() for p in generated_files(ROOT)} >= {
        "ds_configs/zero3.json", "ds_configs/zero3_fp16.json", "ds_configs/zero3_offload_optimizer.json",
        "ds_configs/zero3_offload_all.json", "ds_configs/zero3_nvme.json", "recipes/tiny/ds_config.json"}


def test_no_hand_written_config_beside_the_generated_ones():
    generated = set(generated_files(ROOT))
    committed = set((ROOT / "ds_configs").glob("*.json")) | set((ROOT / "recipes").glob("*/ds_config.json"))
    assert committed == generated


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_auto_only_where_the_bridge_fills_it(name):
    config = build_ds_config(ALL_SPECS[name])
    autos = {key for key, value in _leaves(config) if value == "auto"}
    assert autos <= BRIDGE_FILLED_KEYS
    assert "train_micro_batch_size_per_gpu" in autos  # batch sizes always follow TrainingArguments


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_generated_config_passes_our_checker(name, tmp_path):
    config = _with_nvme(build_ds_config(ALL_SPECS[name]), tmp_path)
    findings = check_ds_config(config, world_size=8, micro_batch=2, grad_accum=4)
    assert [f for f in findings if f.level != "info" and "fp16" not in f.key] == []


def _training_args(tmp_path, precision: str, world_size: int):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, learning_rate=3e-4, weight_decay=0.1,
                             max_grad_norm=0.7, warmup_steps=5, report_to=[])
    # Set after construction: TrainingArguments refuses fp16/bf16 on a CPU-only machine, the bridge only reads them.
    args.bf16 = precision == "bf16"
    args.fp16 = precision == "fp16"
    return mock.patch.object(type(args), "world_size", new=property(lambda self: world_size)), args


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_bridge_fills_every_auto_and_deepspeed_accepts_the_result(name, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import LlamaConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    spec = ALL_SPECS[name]
    precision = spec.precision if spec.precision != "auto" else "fp32"
    world_size = 4
    patch, args = _training_args(tmp_path, precision, world_size)
    config = _with_nvme(build_ds_config(spec), tmp_path)
    try:
        with patch:
            hf_config = HfTrainerDeepSpeedConfig(config)
            hf_config.trainer_config_process(args)
            model = types.SimpleNamespace(config=LlamaConfig(hidden_size=64))
            hf_config.trainer_config_finalize(args, model, num_training_steps=100)
        filled = hf_config.config
        assert [k for k, v in _leaves(filled) if v == "auto"] == []
        assert filled["train_batch_size"] == 2 * 3 * world_size
        assert filled["gradient_clipping"] == 0.7
        if "optimizer" in filled:
            assert filled["optimizer"]["params"]["lr"] == 3e-4
            assert filled["optimizer"]["params"]["weight_decay"] == 0.1
        if spec.stage == 3:
            expected = int(0.9 * 64 * 64) if spec.prefetch_bucket_size == "auto" else spec.prefetch_bucket_size
            assert filled["zero_optimization"]["stage3_prefetch_bucket_size"] == expected
        with mock.patch("deepspeed.comm.get_rank", return_value=0), \
                mock.patch("deepspeed.comm.get_world_size", return_value=world_size):
            ds = DeepSpeedConfig(filled)
        assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
            24, 2, 3)
        assert ds.zero_optimization_stage == spec.stage
        assert ds.bfloat16_config.enabled == (precision == "bf16")
        assert ds.float16_config.enabled == (precision == "fp16")
        if spec.stage == 3:
            assert ds.zero_config.gather_16bit_weights_on_model_save is spec.gather_16bit_weights_on_save
            assert ds.zero_config.overlap_comm is True and ds.zero_config.contiguous_gradients is True
    finally:
        unset_hf_deepspeed_config()


def test_offloaded_optimizer_gets_deepspeed_adamw_and_no_offload_gets_none():
    offloaded = build_ds_config(ZeroSpec(offload_optimizer=OptimizerOffload(device="cpu")))
    assert offloaded["optimizer"] == {"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    assert "optimizer" not in build_ds_config(ZeroSpec())
    assert "scheduler" not in offloaded


def test_activation_checkpointing_maps_to_training_args_not_deepspeed():
    spec = ZeroSpec(activation_checkpointing=True)
    assert "activation_checkpointing" not in build_ds_config(spec)
    assert training_args_overrides(spec)["gradient_checkpointing"] is True


def test_activation_offload_is_written_as_cpu_checkpointing_and_read_back():
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    from hf_zero3.config.convert import spec_from_ds_config

    spec = ZeroSpec(activation_checkpointing=True, activation_offload=True)
    config = build_ds_config(spec)
    assert config["activation_checkpointing"] == {"cpu_checkpointing": True}
    assert "activation_offload" not in training_args_overrides(spec)  # not a stock TrainingArguments field
    assert DeepSpeedActivationCheckpointingConfig(config).cpu_checkpointing is True  # DeepSpeed parses it
    back, notes = spec_from_ds_config(config)
    assert back.activation_offload and back.activation_checkpointing
    assert any("applies as activation offload" in n for n in notes)
    assert "activation_checkpointing" not in build_ds_config(ZeroSpec(activation_checkpointing=True))


def test_nvme_writes_paths_and_aio_block():
    spec = ZeroSpec(offload_optimizer=OptimizerOffload(device="nvme", nvme_path="/nvme"),
                    offload_param=ParamOffload(device="nvme", nvme_path="/nvme"))
    config = build_ds_config(spec)
    assert config["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme"
    assert config["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/nvme"
    assert config["aio"]["block_size"] == 1_048_576
    assert "aio" not in build_ds_config(ZeroSpec(offload_param=ParamOffload(device="cpu")))


def test_stage2_has_no_stage3_keys():
    zero = build_ds_config(ZeroSpec(stage=2))["zero_optimization"]
    assert not [k for k in zero if k.startswith("stage3_")] and "allgather_bucket_size" in zero


def test_build_is_pure():
    spec = ZeroSpec(extra={"flops_profiler": {"enabled": True}})
    first = build_ds_config(spec)
    first["flops_profiler"]["enabled"] = False
    assert render(build_ds_config(spec)) == render(build_ds_config(spec))
    assert build_ds_config(spec)["flops_profiler"] == {"enabled": True}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"stagee": 3}, "Extra inputs are not permitted"),
        ({"stage": 4}, "less than or equal to 3"),
        ({"precision": "fp8"}, "'bf16', 'fp16', 'fp32' or 'auto'"),
        ({"offload_param": {"device": "cpu"}, "stage": 2}, "offload_param needs stage 3"),
        ({"offload_optimizer": {"device": "nvme"}}, 'device "nvme" needs nvme_path'),
        ({"offload_optimizer": {"device": "cpu"}, "stage": 0}, "offload_optimizer needs ZeRO stage 1, 2 or 3"),
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive integer"),
        ({"reduce_bucket_size": -5}, "reduce_bucket_size must be a positive integer"),
        ({"offload_param": {"device": "cpu", "pin_memmory": True}}, "Extra inputs are not permitted"),
    ],
)
def test_spec_rejects_bad_intent(fields, message):
    with pytest.raises(ValidationError, match=message):
        ZeroSpec(**fields)


def test_extra_block_cannot_override_generated_keys():
    with pytest.raises(ValueError, match="collide with generated keys"):
        build_ds_config(ZeroSpec(extra={"zero_optimization": {}}))
