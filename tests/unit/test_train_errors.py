"""`hf-zero3 train` on bad input: exit 2, one clear message naming the fix, nothing written over."""

from __future__ import annotations

import json
import shutil

import pytest

from hf_zero3.train import load_arguments, main
from tests.conftest import ROOT, TINY_YAML

pytestmark = pytest.mark.usefixtures("single_rank_env")


def train_fails(capsys, *overrides) -> str:
    assert main([str(TINY_YAML), "--deepspeed", "null", "--max_steps", "1", *map(str, overrides)]) == 2
    return capsys.readouterr().err


def test_unknown_yaml_key_is_rejected_with_a_suggestion(tmp_path, capsys):
    config = tmp_path / "args.yaml"
    config.write_text(TINY_YAML.read_text() + "learning_rat: 1.0e-4\n")
    assert main([str(config), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "unknown argument(s): learning_rat (did you mean learning_rate?)" in err
    assert not (tmp_path / "out").exists()


def test_unknown_cli_override_is_rejected(capsys, tmp_path):
    err = train_fails(capsys, "--max_step", "3", "--output_dir", tmp_path / "o")
    assert "max_step (did you mean max_steps?)" in err


def test_missing_data_file(capsys, tmp_path):
    err = train_fails(capsys, "--train_file", "no/such/train.txt", "--output_dir", tmp_path / "o")
    assert "'no/such/train.txt' does not exist" in err and "fix the path" in err


def test_empty_data_file(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = train_fails(capsys, "--train_file", empty, "--output_dir", tmp_path / "o")
    assert "is empty" in err


def test_block_size_larger_than_model_positions(capsys, tmp_path):
    err = train_fails(capsys, "--block_size", "1024", "--output_dir", tmp_path / "o")
    assert "block_size=1024 exceeds the model's max positions (512); lower block_size to <= 512" in err


def test_missing_model_path(capsys, tmp_path):
    err = train_fails(capsys, "--model_name_or_path", "./models/no-such-model", "--output_dir", tmp_path / "o")
    assert "model_name_or_path ./models/no-such-model does not exist" in err


def test_tokenizer_larger_than_model_vocab(capsys, tmp_path):
    model = tmp_path / "small_vocab"
    shutil.copytree(ROOT / "assets/tiny/model", model)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 512
    (model / "config.json").write_text(json.dumps(config))
    err = train_fails(capsys, "--config_name", model, "--output_dir", tmp_path / "o")
    assert "the tokenizer has 1024 tokens but the model's vocab_size is 512" in err


def test_output_dir_holding_a_run_is_refused_and_left_untouched(capsys, tmp_path):
    out = tmp_path / "earlier"
    (out / "checkpoint-500").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"weights")
    err = train_fails(capsys, "--output_dir", out)
    assert "already holds a run: pass --resume_from_checkpoint auto" in err and "--overwrite_output_dir" in err
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-500", "model.safetensors"]


def test_fp16_on_cpu_is_refused(capsys, tmp_path):
    err = train_fails(capsys, "--fp16", "true", "--output_dir", tmp_path / "o")
    assert "fp16 is not supported on CPU" in err


def test_missing_config_file(capsys):
    assert main(["no/such/args.yaml"]) == 2
    assert "config file no/such/args.yaml not found" in capsys.readouterr().err


def test_yaml_and_overrides_merge_with_types(tmp_path):
    values = load_arguments([str(TINY_YAML), "--learning_rate", "2e-5", "--max_steps", "7", "--bf16",
                             "--gradient_checkpointing_kwargs", '{"use_reentrant": false}', "--local_rank=1"])
    assert values["learning_rate"] == 2e-5 and values["max_steps"] == 7 and values["bf16"] is True
    assert values["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert values["deepspeed"] == str(ROOT / "recipes/tiny/ds_config.json")  # found next to the YAML
    assert values["block_size"] == 128  # from the YAML


def test_yaml_1_1_booleans_and_null_reach_the_fields_as_meant(tmp_path):
    config = tmp_path / "args.yaml"
    config.write_text("eval_strategy: no\nsave_strategy: no\nlearning_rate: 2e-5\nvalidation_file: null\n")
    values = load_arguments([str(config), "--report_to", "none", "--fsdp_config", '{"fsdp_version": 2}'])
    assert values["eval_strategy"] == values["save_strategy"] == "no"
    assert values["learning_rate"] == 2e-5 and values["validation_file"] is None
    assert values["report_to"] == "none" and values["fsdp_config"] == {"fsdp_version": 2}


@pytest.mark.parametrize("flag, value, message", [("--max_steps", "ten", "max_steps takes a number"),
                                                  ("--bf16", "maybe", "bf16 takes true or false")])
def test_badly_typed_override_names_the_field(capsys, flag, value, message):
    assert main([str(TINY_YAML), flag, value]) == 2
    assert message in capsys.readouterr().err


def test_out_of_memory_gets_a_planner_line_and_other_errors_do_not(capsys, tmp_path):
    import torch
    from transformers import AutoConfig, TrainingArguments

    from hf_zero3.train import _explain_oom

    config = AutoConfig.from_pretrained(ROOT / "assets/tiny/model")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    _explain_oom(RuntimeError("shape mismatch"), config, args, 128)
    assert capsys.readouterr().err == ""
    _explain_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), config, args, 128)
    err = capsys.readouterr().err
    assert "hf_zero3: out of GPU memory." in err
    assert "--gpus N and --gpu-mem SIZE" in err  # this CPU machine has no GPU to plan for: it says so


def test_overwrite_refuses_to_mix_checkpoints_of_two_runs(capsys, tmp_path):
    out = tmp_path / "earlier"
    (out / "checkpoint-1000").mkdir(parents=True)
    (out / "checkpoint-1000" / "model.safetensors").write_bytes(b"old weights")
    err = train_fails(capsys, "--output_dir", out, "--overwrite_output_dir", "true")
    assert "holds checkpoints of an earlier run (checkpoint-1000)" in err and "Move or delete them" in err
    assert (out / "checkpoint-1000" / "model.safetensors").read_bytes() == b"old weights"


def test_override_values_keep_their_dashes_and_dict_floats_are_numbers():
    values = load_arguments([str(TINY_YAML), "--output_dir=outputs/my-run", "--max-steps", "5",
                             "--lr_scheduler_kwargs", '{"min_lr": 1e-5}', "--include_num_input_tokens_seen", "false"])
    assert values["output_dir"] == "outputs/my-run" and values["max_steps"] == 5
    assert values["lr_scheduler_kwargs"] == {"min_lr": 1e-5}
    assert values["include_num_input_tokens_seen"] is False


def test_srun_tasks_without_a_launcher_are_refused_before_anything_runs(monkeypatch, capsys):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert main([str(TINY_YAML), "--deepspeed", "null"]) == 2
    assert "srun started several tasks but no launcher set RANK/WORLD_SIZE" in capsys.readouterr().err
    assert "WORLD_SIZE" not in __import__("os").environ


def test_push_to_hub_without_a_repo_id_is_a_usage_error_before_training(capsys, tmp_path):
    err = train_fails(capsys, "--push_to_hub", "true", "--output_dir", tmp_path / "o")
    assert "set hub_model_id to ORG/NAME" in err
