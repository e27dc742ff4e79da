"""`check_ds_config` and `hf-zero3 config check|new`: one test per rule, with the message a user sees."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hf_zero3.cli import main as cli
from hf_zero3.config.build import build_ds_config
from hf_zero3.config.check import check_ds_config, has_errors
from hf_zero3.config.presets import STANDALONE_CONFIGS
from tests.conftest import error_naming

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SEED = FIXTURES / "seed_ds_config.json"
SHARED_SEED = Path(__file__).resolve().parents[3] / "shared" / "seed_ds_config.json"


def good() -> dict:
    return copy.deepcopy(build_ds_config(STANDALONE_CONFIGS["zero3"]))


def ta(**overrides) -> dict:
    """TrainingArguments values as `hf-zero3 train` passes them to the checker: defaults plus overrides."""
    from hf_zero3.run.checks import training_values

    return training_values(overrides)


def messages(config, level="error", **kwargs):
    return [f"{f.key}: {f.message}" for f in check_ds_config(config, **kwargs) if f.level == level]


def edit(path: str, value, config=None) -> dict:
    config = config or good()
    node = config
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


def test_a_good_config_has_no_errors_or_warnings():
    assert check_ds_config(good(), world_size=8, micro_batch=4, grad_accum=2, device="cuda") == []


BAD_INPUTS = [
    # (name, config, kwargs, (the field, then what the error must name with it: the value, the fix))
    ("unknown top-level key", edit("zero_optimisation", {"stage": 3}), {},
     ("zero_optimisation:", "unknown", "'zero_optimization'")),
    ("unknown zero key", edit("zero_optimization.overlap_com", True), {},
     ("zero_optimization.overlap_com:", "unknown", "'overlap_comm'")),
    ("unknown offload key", edit("zero_optimization.offload_param", {"device": "cpu", "pin_memmory": True}), {},
     ("zero_optimization.offload_param.pin_memmory:", "unknown", "'pin_memory'")),
    ("unknown optimizer key", edit("optimizer", {"type": "AdamW", "param": {}}), {},
     ("optimizer.param:", "unknown", "'params'")),
    ("batch mismatch", edit("train_batch_size", 64), {"world_size": 4, "micro_batch": 2, "grad_accum": 4},
     ("train_batch_size: 64", "= 32", "set train_batch_size to 32")),
    ("batch not divisible", {**good(), "train_batch_size": 30, "gradient_accumulation_steps": 4}, {"world_size": 8},
     ("train_batch_size: 30", "not divisible", "accumulation 4", "world size 8")),
    ("micro batch conflicts with --micro-batch", edit("train_micro_batch_size_per_gpu", 4), {"micro_batch": 2},
     ("train_micro_batch_size_per_gpu:", "4", "--micro-batch is 2")),
    ("fp16 and bf16 both on", edit("fp16", {"enabled": True}), {},
     ("fp16.enabled:", "bf16", "keep one")),
    ("fp16 on cpu", {**good(), "bf16": {"enabled": False}, "fp16": {"enabled": True}}, {"device": "cpu"},
     ("fp16.enabled:", "CPU")),
    ("nvme without path", edit("zero_optimization.offload_param", {"device": "nvme"}), {},
     ("zero_optimization.offload_param.nvme_path:", "needs nvme_path")),
    ("nvme path missing", edit("zero_optimization.offload_param", {"device": "nvme", "nvme_path": "/no/such/nvme"}),
     {}, ("zero_optimization.offload_param.nvme_path:", "/no/such/nvme", "create it")),
    ("nvme path not writable", edit("zero_optimization.offload_param", {"device": "nvme", "nvme_path": "/proc"}),
     {}, ("zero_optimization.offload_param.nvme_path:", "/proc", "not writable")),
    ("offloaded optimizer without optimizer block", edit("zero_optimization.offload_optimizer", {"device": "cpu"}),
     {}, ("optimizer:", "offloaded", "no optimizer block")),
    ("auto nobody fills", edit("zero_optimization.sub_group_size", "auto"), {},
     ("zero_optimization.sub_group_size:", "'auto'", "filled by nobody")),
    ("auto in an unfilled optimizer param", edit("optimizer", {"type": "AdamW", "params": {"amsgrad": "auto"}}), {},
     ("optimizer.params.amsgrad:", "'auto'", "filled by nobody")),
    ("stage out of range", edit("zero_optimization.stage", 4), {},
     ("zero_optimization.stage:", "0, 1, 2 or 3", "got 4")),
    ("negative bucket", edit("zero_optimization.reduce_bucket_size", -1), {},
     ("zero_optimization.reduce_bucket_size:", "positive", "got -1")),
    ("zero micro batch", edit("train_micro_batch_size_per_gpu", 0), {},
     ("train_micro_batch_size_per_gpu:", "positive", "got 0")),
    ("zero buffer count", edit("zero_optimization.offload_param", {"device": "cpu", "buffer_count": 0}), {},
     ("zero_optimization.offload_param.buffer_count:", "positive", "got 0")),
    ("param offload below stage 3", edit("zero_optimization.offload_param", {"device": "cpu"},
                                         edit("zero_optimization.stage", 2)), {},
     ("zero_optimization.offload_param:", "stage 3", "stage is 2")),
    ("wrong type", edit("zero_optimization.overlap_comm", "yes please"), {},
     ("zero_optimization.overlap_comm:", "'yes please'")),
    ("unknown monitor key", edit("tensorboard", {"enabeld": True}), {},
     ("tensorboard.enabeld:", "unknown", "'enabled'")),
    ("unknown flops_profiler key", edit("flops_profiler", {"enable": True}), {},
     ("flops_profiler.enable:", "unknown", "'enabled'")),
    ("unknown nested timers key", edit("timers", {"throughput": {"enable": True}}), {},
     ("timers.throughput.enable:", "unknown", "'enabled'")),
    ("misspelt scheduler parameter", edit("scheduler", {"type": "WarmupLR", "params": {"warmup_num_step": 10}}), {},
     ("scheduler.params.warmup_num_step:", "WarmupLR", "'warmup_num_steps'")),
    ("unknown scheduler", edit("scheduler", {"type": "WarmupLinear"}), {},
     ("scheduler.type:", "'WarmupLinear'", "WarmupLR")),
    ("stage true", edit("zero_optimization.stage", True), {},
     ("zero_optimization.stage:", "0, 1, 2 or 3", "got True")),
    ("negative micro batch in TrainingArguments", good(), {"training_args": ta(bf16=True,
                                                                              per_device_train_batch_size=-1)},
     ("per_device_train_batch_size:", ">= 1", "got -1")),
    ("zero accumulation in TrainingArguments", good(), {"training_args": ta(bf16=True, gradient_accumulation_steps=0)},
     ("gradient_accumulation_steps:", ">= 1", "got 0")),
    ("micro batch differs from TrainingArguments", edit("train_micro_batch_size_per_gpu", 4),
     {"training_args": ta(bf16=True, per_device_train_batch_size=2)},
     ("train_micro_batch_size_per_gpu:", "4", "per_device_train_batch_size is 2")),
    ("batch vs world size and TrainingArguments", edit("train_batch_size", 64),
     {"world_size": 2, "training_args": ta(bf16=True)},
     ("train_batch_size: 64", "world size 2", "= 16")),
    ("bf16 in the config, --fp16 in TrainingArguments", edit("fp16", {"enabled": "auto"}),
     {"training_args": ta(fp16=True)}, ("fp16.enabled:", "bf16", "both")),
    ("--fp16 and --bf16 filled into auto", edit("fp16", {"enabled": "auto"}, edit("bf16", {"enabled": "auto"})),
     {"training_args": ta(fp16=True, bf16=True)}, ("fp16.enabled:", "bf16", "both")),
    ("bf16 in the config without --bf16", good(), {"training_args": ta()},
     ("bf16.enabled:", "bf16 is false", "set bf16.enabled to 'auto'")),
    ("SuperOffload on CPU ranks", edit("zero_optimization.offload_optimizer", {"device": "cpu", "super_offload": True},
                                       edit("optimizer", {"type": "AdamW", "params": {}})), {"device": "cpu"},
     ("zero_optimization.offload_optimizer.super_offload:", "NVIDIA GPU")),
    ("SuperOffload without an offloaded optimizer", edit("zero_optimization.offload_optimizer",
                                                         {"device": "none", "super_offload": True}), {"device": "cuda"},
     ("super_offload", "offload_optimizer.device 'cpu'", "device 'none'")),
    ("gradient_clipping differs from max_grad_norm", edit("gradient_clipping", 0.5),
     {"training_args": ta(bf16=True)},
     ("gradient_clipping:", "0.5", "max_grad_norm is 1.0")),
]


@pytest.mark.parametrize("name, config, kwargs, expected", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_an_error_naming_the_fix(name, config, kwargs, expected):
    error_naming("\n".join(messages(config, **kwargs)), *expected)
    assert has_errors(check_ds_config(config, **kwargs))


def test_a_good_config_with_matching_training_arguments_has_no_errors_or_warnings():
    args = ta(bf16=True, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert check_ds_config(good(), world_size=8, device="cuda", training_args=args) == []
    explicit = {**good(), "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}
    assert check_ds_config(explicit, world_size=8, device="cuda", training_args=args) == []


def test_at_least_fifteen_distinct_bad_inputs():
    assert len({b[3] for b in BAD_INPUTS}) >= 15


def test_all_findings_are_reported_at_once():
    config = edit("zero_optimization.stage", 4, edit("zero_optimisation", {}, edit("fp16", {"enabled": True})))
    errors = messages(config)
    assert len(errors) >= 3, errors


def test_noop_activation_checkpointing_block_is_a_warning_with_the_alternative():
    warnings = messages(edit("activation_checkpointing", {"partition_activations": True}), level="warning")
    assert any("HF models never call" in w and "gradient_checkpointing: true" in w for w in warnings)


def test_cpu_checkpointing_is_applied_by_train_and_named_a_no_op_for_plain_scripts():
    config = edit("activation_checkpointing", {"cpu_checkpointing": True})
    assert not any("activation_checkpointing" in w for w in messages(config, level="warning"))
    infos = [m for m in messages(config, level="info") if "activation offload" in m]
    assert len(infos) == 1 and "plain `--deepspeed` script it does nothing unless" in infos[0], infos
    assert "activation_offload.enable(model)" in infos[0]


def test_stage3_without_gathered_weights_is_a_warning_unless_chosen():
    """Left out, DeepSpeed's default (off) surprises; set false, it is a choice (the planner's where host RAM is
    short), named with how to get the weights."""
    chosen = edit("zero_optimization.stage3_gather_16bit_weights_on_model_save", False)
    assert not any("stage3_gather" in w for w in messages(chosen, level="warning"))
    assert any("writes no usable weights" in m and "hf-zero3 export" in m for m in messages(chosen, level="info"))
    left_out = copy.deepcopy(chosen)
    del left_out["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    assert any("writes no usable weights" in w for w in messages(left_out, level="warning"))


def test_seed_fixture_is_the_seed():
    if SHARED_SEED.exists():
        assert json.loads(SHARED_SEED.read_text()) == json.loads(SEED.read_text())


def test_check_seed_config_reports_what_the_seed_gets_wrong(capsys):
    rc = cli(["config", "check", str(SEED), "--world-size", "8", "--device", "cuda"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "micro batch = 1 is implied (32 / 4 / 8)" in out
    error_naming(out, "partition_activations", "gradient_checkpointing: true")
    error_naming(out, "cpu_checkpointing", "hf-zero3 train", "activation offload")
    assert "the optimizer is offloaded but there is no optimizer block" in out
    assert "prefer bf16" in out
    assert "1 error(s)" in out


def test_new_never_replaces_an_existing_file_unless_forced(tmp_path, capsys):
    out_file = tmp_path / "ds_config.json"
    out_file.write_text("{\"mine\": true}\n")
    assert cli(["config", "new", "--stage", "3", "-o", str(out_file)]) == 2
    error_naming(capsys.readouterr().err, f"{out_file} exists", "--force")
    assert out_file.read_text() == "{\"mine\": true}\n"
    assert cli(["config", "new", "--stage", "3", "-o", str(out_file), "--force"]) == 0
    assert json.loads(out_file.read_text())["zero_optimization"]["stage"] == 3


def test_new_like_seed_writes_the_corrected_equivalent(tmp_path, capsys):
    out_file = tmp_path / "fixed.json"
    assert cli(["config", "new", "--like", str(SEED), "--world-size", "8", "-o", str(out_file)]) == 0
    err = capsys.readouterr().err
    fixed = json.loads(out_file.read_text())
    assert fixed["optimizer"]["type"] == "AdamW"
    assert fixed["activation_checkpointing"] == {"cpu_checkpointing": True}  # train applies it: activation offload
    assert "gradient_checkpointing" in err and "kept cpu_checkpointing: true" in err
    assert (fixed["train_batch_size"], fixed["gradient_accumulation_steps"],
            fixed["train_micro_batch_size_per_gpu"]) == (32, 4, 1)
    zero = fixed["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert fixed["fp16"]["enabled"] is True and fixed["wall_clock_breakdown"] is True
    assert cli(["config", "check", str(out_file), "--world-size", "8", "--device", "cuda"]) == 0


def test_new_from_options_round_trips_through_check(tmp_path, capsys):
    out_file = tmp_path / "c.json"
    rc = cli(["config", "new", "--offload-optimizer", "nvme", "--offload-param", "nvme", "--nvme-path",
              str(tmp_path), "--activation-checkpointing", "-o", str(out_file)])
    assert rc == 0
    config = json.loads(out_file.read_text())
    assert config["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    assert "--gradient_checkpointing True" in capsys.readouterr().err
    assert cli(["config", "check", str(out_file)]) == 0


def test_new_rejects_inconsistent_options(capsys):
    assert cli(["config", "new", "--stage", "2", "--offload-param", "cpu"]) == 2
    assert "offload_param needs stage 3" in capsys.readouterr().err


def test_check_reports_malformed_and_missing_files(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "zero_optimization": {"stage": 3,}\n}')
    assert cli(["config", "check", str(bad)]) == 1
    assert f"{bad} is not valid JSON (line 2, column 36)" in capsys.readouterr().out
    assert cli(["config", "check", str(tmp_path / "missing.json")]) == 1
    assert "not found" in capsys.readouterr().out


def test_bfloat16_alias_is_flagged_and_converted():
    config = good()
    config["bfloat16"] = config.pop("bf16")
    assert any("Rename it 'bf16'" in w for w in messages(config, level="warning"))
    both = {**good(), "bfloat16": {"enabled": True}}
    assert any("both 'bf16' and its old alias" in e for e in messages(both))
    from hf_zero3.config.convert import spec_from_ds_config

    spec, _ = spec_from_ds_config(config)
    assert spec.precision == "bf16" and "bfloat16" not in build_ds_config(spec)


def test_offload_without_optimizer_block_is_fine_when_the_user_forces_a_client_optimizer():
    config = edit("zero_optimization.offload_optimizer", {"device": "cpu"})
    config["zero_force_ds_cpu_optimizer"] = False
    assert not any(e.startswith("optimizer:") for e in messages(config))


def test_like_notes_every_value_it_does_not_carry(tmp_path, capsys):
    from hf_zero3.config.convert import spec_from_ds_config

    spec, notes = spec_from_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                                       "zero_optimization": {"stage": 3, "offload_optimizer": {
                                           "device": "cpu", "ratio": 0.5, "pipeline_read": True}}})
    assert any("['pipeline_read']" in n for n in notes) and any("'lr': 0.0003" in n and "--learning_rate" in n
                                                                for n in notes)
    assert spec.offload_optimizer.ratio == 0.5  # partial offload is modelled, so it is carried over
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}}))
    assert cli(["config", "new", "--like", str(bad)]) == 2
    assert "cannot convert" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--no-pin-memory"], ["--offload-ratio", "0.5"]])
def test_new_refuses_offload_settings_without_offload(capsys, flag):
    assert cli(["config", "new", "--stage", "3", *flag]) == 2
    err = capsys.readouterr().err
    assert "but they are not: add --offload-optimizer cpu" in err, err


def test_the_one_gpu_persistence_on_more_ranks_is_a_warning():
    """`stage3_param_persistence_threshold: EVERY_PARAMETER` (the planner's one-GPU choice) on 2 ranks keeps the
    whole 16-bit model on each GPU; a threshold below the layer matrices, or one rank, is nothing to report."""
    from hf_zero3.config.spec import EVERY_PARAMETER

    everything = edit("zero_optimization.stage3_param_persistence_threshold", EVERY_PARAMETER)
    warned = messages(everything, "warning", world_size=2)
    assert any("keeps every parameter whole on each of the 2 ranks" in m and '"auto"' in m for m in warned), warned
    assert not [m for m in messages(everything, "warning", world_size=1) if "persistence" in m]
    assert not [m for m in messages(everything, "warning") if "persistence" in m]  # world size unknown
    below = edit("zero_optimization.stage3_param_persistence_threshold", 100_000_000)
    assert not [m for m in messages(below, "warning", world_size=8) if "persistence" in m]
    as_float = edit("zero_optimization.stage3_param_persistence_threshold", 1e11)
    assert [m for m in messages(as_float, "warning", world_size=2) if "persistence" in m]


def test_a_warmup_scheduler_without_warmup_is_refused_before_start_where_deepspeed_would_stop_the_run():
    """DeepSpeed 0.19.6+ refuses warmup_num_steps < 1 when the engine starts (after the model loaded); transformers
    before 5.18 fills "auto" with warmup_steps as it is (0 by default), 5.18+ with at least 1. On the 1 x H200 box
    (transformers 5.17, DeepSpeed 0.19.8) the stock template stopped with `warmup_num_steps must be a positive
    integer, got 0` (benchmarks/results/2026-12-03_lora-8b-h200/stock_peft.log)."""
    from hf_zero3.config.trainer_findings import warmup_findings

    [old] = warmup_findings("WarmupLR", "auto", 0.0, (5, 17, 0), (0, 19, 8))
    assert old.level == "error" and old.key == "scheduler.params.warmup_num_steps"
    assert "set warmup_steps to 1 or more" in old.message and "remove the scheduler block" in old.message
    [new] = warmup_findings("WarmupLR", "auto", 0.0, (5, 18, 0), (0, 19, 8))
    assert new.level == "warning" and "the first step trains at the warmup's lowest learning rate" in new.message
    [clamped] = warmup_findings("WarmupDecayLR", "auto", 0.0, (5, 17, 0), (0, 19, 5))  # DeepSpeed raised it to 2
    assert clamped.level == "warning"
    [explicit] = warmup_findings("WarmupCosineLR", 0, None, (5, 24, 0), (0, 19, 8))
    assert explicit.level == "error" and "set scheduler.params.warmup_num_steps to 1 or more" in explicit.message
    assert warmup_findings("WarmupLR", "auto", 10.0, (5, 17, 0), (0, 19, 8)) == []
    assert warmup_findings("WarmupLR", "auto", 0.05, (5, 17, 0), (0, 19, 8)) == []  # a ratio of the steps
    assert warmup_findings("WarmupLR", 5, None, (5, 17, 0), (0, 19, 8)) == []


def test_the_warmup_check_runs_on_what_is_installed_and_deepspeed_refuses_what_it_calls_an_error():
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR

    from hf_zero3.config.trainer_findings import DEEPSPEED_REFUSES_NO_WARMUP, _version
    from hf_zero3.ops.baselines import STOCK_ZERO3

    stock = copy.deepcopy(STOCK_ZERO3)
    findings = [f for f in check_ds_config(stock, training_args=ta(warmup_steps=0))
                if f.key == "scheduler.params.warmup_num_steps"]
    assert len(findings) == 1
    assert [f for f in check_ds_config(stock, training_args=ta(warmup_steps=10))
            if f.key == "scheduler.params.warmup_num_steps"] == []
    assert [f for f in check_ds_config({k: v for k, v in stock.items() if k != "scheduler"},
                                       training_args=ta(warmup_steps=0)) if "warmup" in f.key] == []
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    if _version("deepspeed") >= DEEPSPEED_REFUSES_NO_WARMUP:
        with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
            WarmupLR(optimizer, warmup_num_steps=0)


def test_steps_per_print_inf_reads_as_never_print():
    """accelerate writes `steps_per_print: inf` into the ds_config a Trainer runs with (DeepSpeed's never)."""
    from hf_zero3.config.convert import spec_from_ds_config

    spec, _ = spec_from_ds_config({**good(), "steps_per_print": float("inf")})
    assert spec.steps_per_print is None and "steps_per_print" not in build_ds_config(spec)
    assert spec_from_ds_config(good())[0].steps_per_print == 2000
    assert "steps_per_print" not in spec_from_ds_config({k: v for k, v in good().items()
                                                         if k != "steps_per_print"})[0].model_dump(exclude_unset=True)


def test_superoffload_with_an_offloaded_optimizer_on_gpus_is_accepted():
    config = edit("zero_optimization.offload_optimizer", {"device": "cpu", "super_offload": True},
                  edit("optimizer", {"type": "AdamW", "params": {}}))
    assert not [f for f in check_ds_config(config, device="cuda") if "super_offload" in f.key]
