"""Inputs DeepSpeed 0.19 refuses, ignores or mis-reads: `config check` names each, `config new --like` never copies
them silently, and no valid JSON of the wrong shape ends in a traceback."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from pydantic import ValidationError

from hf_zero3.cli import main as cli
from hf_zero3.config.build import build_ds_config
from hf_zero3.config.check import check_ds_config, has_errors
from hf_zero3.config.convert import spec_from_ds_config
from hf_zero3.config.presets import STANDALONE_CONFIGS
from hf_zero3.config.spec import OptimizerOffload, ZeroSpec
from tests.conftest import error_naming

REMOVED_BLOCKS = ["amp", "nebula", "compression_training", "quantize_training", "sparse_gradients", "eigenvalue",
                  "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop"]


def good() -> dict:
    return build_ds_config(STANDALONE_CONFIGS["zero3"])


def findings(config, level="error", **kwargs) -> list[str]:
    return [f"{f.key}: {f.message}" for f in check_ds_config(config, **kwargs) if f.level == level]


def deepspeed_config(config: dict, world_size: int = 4):
    from deepspeed.runtime.config import DeepSpeedConfig

    with mock.patch("deepspeed.comm.get_rank", return_value=0), \
            mock.patch("deepspeed.comm.get_world_size", return_value=world_size):
        return DeepSpeedConfig(config)


@pytest.mark.parametrize("key", REMOVED_BLOCKS)
def test_blocks_deepspeed_removed_are_errors_with_its_reason(key):
    config = {**good(), key: {"enabled": True}}
    with pytest.raises(Exception, match="removed"):  # DeepSpeedConfigError at start-up: the claim we report
        deepspeed_config({"train_batch_size": 4, key: {"enabled": True}})
    errors = [e for e in findings(config) if e.startswith(f"{key}:")]
    assert len(errors) == 1 and "refuses to start with it" in errors[0] and "has been removed" in errors[0], errors
    assert f"Remove '{key}' from the config" in errors[0]


def test_removed_zero_key_names_deepspeeds_reason():
    errors = findings({**good(), "zero_optimization": {**good()["zero_optimization"], "mics_shard_size": 2}})
    assert any(e.startswith("zero_optimization.mics_shard_size: removed from DeepSpeed") and "MiCS" in e
               for e in errors), errors


@pytest.mark.parametrize("key", ["mics_shard_size", "mics_hierarchical_params_gather"])
def test_top_level_mics_keys_are_unknown(key):
    assert any(e.startswith(f"{key}: unknown top-level key") for e in findings({**good(), key: 2}))


def test_like_drops_removed_blocks_with_a_note(tmp_path, capsys):
    source = tmp_path / "old.json"
    source.write_text(json.dumps({"zero_optimization": {"stage": 3}, "amp": {"enabled": True}, "nebula": {},
                                  "flops_profiler": {"enabled": False}}))
    out = tmp_path / "new.json"
    assert cli(["config", "new", "--like", str(source), "-o", str(out)]) == 0
    written, err = json.loads(out.read_text()), capsys.readouterr().err
    assert "amp" not in written and "nebula" not in written and written["flops_profiler"] == {"enabled": False}
    error_naming(err, "dropped 'amp'", "DeepSpeed refuses to start with it")
    assert "note: dropped 'nebula'" in err and "unknown top-level keys" not in err


def test_datastates_checkpointing_is_a_known_block():
    config = {**good(), "datastates_ckpt": {"host_cache_size": 16}}
    assert deepspeed_config({"train_batch_size": 4, "datastates_ckpt": {"host_cache_size": 16}}).datastates_config.enabled
    assert not [e for e in findings(config) if e.startswith("datastates_ckpt")]
    assert spec_from_ds_config(config)[0].extra == {"datastates_ckpt": {"host_cache_size": 16}}


def test_aio_thread_count_is_reported_as_ignored():
    config = {**good(), "aio": {"thread_count": 4}}
    assert "thread_count" not in deepspeed_config({"train_batch_size": 4, "aio": {"thread_count": 4}}).aio_config  # ignored
    warnings = findings(config, "warning")
    assert any(w.startswith("aio.thread_count: DeepSpeed 0.19 ignores it") and "intra_op_parallelism" in w
               for w in warnings), warnings


def test_batch_not_divisible_by_world_size_is_an_error():
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_config({"train_batch_size": 33}, world_size=4)
    errors = findings({"train_batch_size": 33}, world_size=4)
    assert len(errors) == 1, errors
    error_naming(errors[0], "train_batch_size: 33", "world size 4", "multiple of 4", "'auto'")
    assert findings({"train_batch_size": 32}, world_size=4) == []
    assert any("micro batch 32 / 4" in i for i in findings({"train_batch_size": 32}, "info", world_size=4))


@pytest.mark.parametrize("old, new", [
    ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
    ("cpu_offload", "offload_optimizer"),
])
def test_deprecated_key_with_its_replacement_is_a_finding_not_a_crash(old, new, tmp_path, capsys):
    zero = {"stage": 3, old: True, new: {"device": "cpu"} if new == "offload_optimizer" else True}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**good(), "zero_optimization": zero}))
    assert cli(["config", "check", str(path), "--device", "any"]) == 1
    out = capsys.readouterr().out
    error_naming(out, f"zero_optimization.{old}", "ERROR", "deprecated")
    assert f"remove the deprecated '{old}'" in out


@pytest.mark.parametrize("config, expected", [
    ({"fp16": [1]}, ("fp16", "JSON object", "[1]")),
    ({"bf16": "yes"}, ("bf16", "JSON object", '"yes"')),
    ({"bf16": {"enabled": "yes"}}, ("bf16.enabled", 'true, false or "auto"', '"yes"')),
    ({"zero_optimization": [1]}, ("zero_optimization", "JSON object", "[1]")),
    ({"optimizer": "adam"}, ("optimizer", "JSON object", '"adam"')),
    ({"optimizer": {"type": "AdamW", "params": [1]}}, ("optimizer.params", "JSON object")),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}},
     ("zero_optimization.offload_optimizer", "JSON object", '"cpu"')),
    ({"zero_optimization": {"stage": 3, "offload_param": "cpu"}}, ("zero_optimization.offload_param", "JSON object")),
    ({"aio": 3}, ("aio", "JSON object", "3")),
    ({"activation_checkpointing": [1]}, ("activation_checkpointing", "JSON object")),
])
def test_like_with_a_block_of_the_wrong_type_is_a_clean_error(config, expected, tmp_path, capsys):
    """The block at fault, what it must be and what it was; `config new --like` prints it with the file, exit 2."""
    with pytest.raises(ValueError) as raised:
        spec_from_ds_config(config)
    error_naming(str(raised.value), *expected)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    assert cli(["config", "new", "--like", str(path)]) == 2
    error_naming(capsys.readouterr().err, f"error: cannot convert {path}", *expected)


def test_like_carries_aio_tuning_and_notes_what_it_drops():
    spec, notes = spec_from_ds_config({
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
        "aio": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": True,
                "overlap_events": False, "thread_count": 2}})
    assert build_ds_config(spec)["aio"] == {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 4,
                                            "single_submit": True, "overlap_events": False}
    assert any("['thread_count']" in n and "use intra_op_parallelism" in n for n in notes), notes
    _, notes = spec_from_ds_config({"zero_optimization": {"stage": 3}, "aio": {"queue_depth": 32}})
    assert any("dropped the aio block" in n for n in notes), notes


def test_like_notes_a_changed_optimizer_type_and_dropped_params():
    _, notes = spec_from_ds_config({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "Lamb", "legacy_fusion": False, "params": {"lr": "auto", "bias_correction": False}}})
    assert any("replaced optimizer type 'Lamb' by 'AdamW'" in n for n in notes), notes
    assert any("['legacy_fusion', 'params.bias_correction']" in n for n in notes), notes
    _, notes = spec_from_ds_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                                    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert not [n for n in notes if "optimizer" in n and "replaced" in n]
    _, notes = spec_from_ds_config({"optimizer": {"type": "Lamb"}})
    assert any('dropped the optimizer block ({"type": "Lamb"})' in n for n in notes), notes


def test_like_notes_fp16_keys_it_does_not_model():
    spec, notes = spec_from_ds_config({"fp16": {"enabled": True, "auto_cast": True, "consecutive_hysteresis": True,
                                                "loss_scale_window": 500}})
    assert spec.fp16.loss_scale_window == 500
    assert any("not carried over from fp16" in n and "['auto_cast', 'consecutive_hysteresis']" in n
               for n in notes), notes


def test_optimizer_nvme_offload_below_stage_3_is_refused():
    config = {**good(), "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}
    error_naming("\n".join(findings(config)), "zero_optimization.offload_optimizer.device:", "stage 3",
                 "stage is 2", "device to 'cpu'")
    config["zero_optimization"]["stage"] = 3
    assert not [e for e in findings(config) if "needs ZeRO stage 3" in e]
    with pytest.raises(ValidationError, match='device "nvme" needs stage 3 \\(stage is 1\\)'):
        ZeroSpec(stage=1, offload_optimizer=OptimizerOffload(device="nvme", nvme_path="/nvme"))
    ZeroSpec(stage=3, offload_optimizer=OptimizerOffload(device="nvme", nvme_path="/nvme"))


@pytest.mark.parametrize("optimizer, expected", [
    ({"type": "AdamW", "params": {"weight_decy": 0.1}},
     ("optimizer.params.weight_decy:", "AdamW", "'weight_decay'")),
    ({"type": "Lamb", "params": {"betas": [0.9, 0.99], "max_coef": 1.0}},
     ("optimizer.params.max_coef:", "Lamb", "'max_coeff'")),
    ({"type": "Adam", "params": {"adamw_mode": True}},
     ("optimizer.params.adamw_mode:", "Adam", "'adam_w_mode'")),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}},
     ("optimizer.params.max_grad_norm:", "gradient_clipping")),
    ({"type": "AdamWW"}, ("optimizer.type:", "'AdamWW'", "'adamw'")),
    ({"type": "sgd"}, ("optimizer.type:", "unknown optimizer 'sgd'")),  # torch.optim.sgd is a module, not the class
    ({"type": 3}, ("optimizer.type:", "unknown optimizer 3")),
    ({"params": {"lr": 1e-3}}, ("optimizer.type:", "missing")),
    ("adam", ("optimizer:", '"adam"', '{"type": "adam", "params": {}}')),
])
def test_bad_optimizer_block_is_an_error(optimizer, expected):
    """Each names the key at fault (the line starts with it), the value, and the fix where there is one."""
    field, *fix = expected
    errors = [e for e in findings({**good(), "optimizer": optimizer}) if e.startswith(field)]
    error_naming("\n".join(errors), field, *fix)


@pytest.mark.parametrize("optimizer", [
    {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                 "bias_correction": True, "adam_w_mode": True, "amsgrad": False, "torch_adam": True,
                                 "fused": True, "fp32_optimizer_states": True}},
    {"type": "adam", "params": {"lr": 1e-4}},
    {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 10.0, "min_coeff": 0.01, "bias_correction": True}},
    {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
    {"type": "MuAdamW", "params": {"lr": 1e-4}},
])
def test_valid_optimizer_blocks_pass(optimizer):
    assert not [e for e in findings({**good(), "optimizer": optimizer}) if e.startswith("optimizer")]


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_new_refuses_a_non_finite_or_negative_gradient_clipping(value, capsys):
    assert cli(["config", "new", "--gradient-clipping", value]) == 2
    assert "gradient_clipping must be a finite number >= 0 or 'auto'" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="finite number"):
        ZeroSpec(gradient_clipping=float(value))


def test_new_writes_a_finite_gradient_clipping(capsys):
    assert cli(["config", "new", "--gradient-clipping", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["gradient_clipping"] == 0.5


def test_generated_configs_still_check_clean():
    for name, spec in STANDALONE_CONFIGS.items():
        if not spec.offloads_to_nvme:
            assert not has_errors(check_ds_config(build_ds_config(spec), world_size=8)), name
