"""`hf-zero3 train` on bad input: exit 2, one clear message naming the fix, nothing written over."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from hf_zero3.job.arguments import UsageError, load_arguments
from hf_zero3.run.train import main
from tests.conftest import ROOT, TINY_YAML, error_naming

pytestmark = pytest.mark.usefixtures("single_rank_env")


def train_fails(capsys, *overrides) -> str:
    assert main([str(TINY_YAML), "--deepspeed", "null", "--max_steps", "1", *map(str, overrides)]) == 2
    return capsys.readouterr().err


def test_unknown_yaml_key_is_rejected_with_a_suggestion(tmp_path, capsys):
    config = tmp_path / "args.yaml"
    config.write_text(TINY_YAML.read_text() + "learning_rat: 1.0e-4\n")
    assert main([str(config), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    error_naming(err, "learning_rat", "learning_rate")
    assert not (tmp_path / "out").exists()


def test_unknown_cli_override_is_rejected(capsys, tmp_path):
    err = train_fails(capsys, "--max_step", "3", "--output_dir", tmp_path / "o")
    error_naming(err, "max_step", "max_steps")


def test_missing_data_file(capsys, tmp_path):
    err = train_fails(capsys, "--train_file", "no/such/train.txt", "--output_dir", tmp_path / "o")
    error_naming(err, "train_file", "no/such/train.txt", "does not exist", "fix the path")


def test_empty_data_file(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = train_fails(capsys, "--train_file", empty, "--output_dir", tmp_path / "o")
    error_naming(err, "train_file", "is empty", "point train_file at a file")


def test_block_size_larger_than_model_positions(capsys, tmp_path):
    err = train_fails(capsys, "--block_size", "1024", "--output_dir", tmp_path / "o")
    error_naming(err, "block_size", "512", "lower block_size to <= 512")


def test_missing_model_path(capsys, tmp_path):
    err = train_fails(capsys, "--model_name_or_path", "./models/no-such-model", "--output_dir", tmp_path / "o")
    error_naming(err, "model_name_or_path", "does not exist", "point it at a model folder")


def test_tokenizer_larger_than_model_vocab(capsys, tmp_path):
    model = tmp_path / "small_vocab"
    shutil.copytree(ROOT / "assets/tiny/model", model)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 512
    (model / "config.json").write_text(json.dumps(config))
    err = train_fails(capsys, "--config_name", model, "--output_dir", tmp_path / "o")
    error_naming(err, "vocab_size", "1024 tokens", "512", "tokenizer_name", "raise vocab_size")


def test_output_dir_holding_a_run_is_refused_and_left_untouched(capsys, tmp_path):
    out = tmp_path / "earlier"
    (out / "checkpoint-500").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"weights")
    err = train_fails(capsys, "--output_dir", out)
    error_naming(err, "output_dir", "already holds a run", "--resume_from_checkpoint auto", "--overwrite_output_dir")
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-500", "model.safetensors"]


def test_fp16_on_cpu_is_refused(capsys, tmp_path):
    err = train_fails(capsys, "--fp16", "true", "--output_dir", tmp_path / "o")
    error_naming(err, "fp16", "not supported on CPU", "drop --fp16", "--bf16 true")


def test_missing_config_file(capsys):
    assert main(["no/such/args.yaml"]) == 2
    error_naming(capsys.readouterr().err, "no/such/args.yaml", "not found", "pass a YAML of training arguments")


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


@pytest.mark.parametrize("flag, value, fix", [("--max_steps", "ten", "a number"), ("--bf16", "maybe", "true or false")])
def test_badly_typed_override_names_the_field(capsys, flag, value, fix):
    assert main([str(TINY_YAML), flag, value]) == 2
    error_naming(capsys.readouterr().err, flag.removeprefix("--"), fix, value)


def test_out_of_memory_gets_a_planner_line_and_other_errors_do_not(capsys, tmp_path):
    import torch
    from transformers import AutoConfig, TrainingArguments

    from hf_zero3.run.train import _explain_oom

    config = AutoConfig.from_pretrained(ROOT / "assets/tiny/model")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    _explain_oom(RuntimeError("shape mismatch"), config, args, 128)
    assert capsys.readouterr().err == ""
    _explain_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), config, args, 128)
    err = capsys.readouterr().err
    assert "hf_zero3: out of GPU memory." in err
    assert "--gpus N and --gpu-mem SIZE" in err  # this CPU machine has no GPU to plan for: it says so


def test_a_log_that_ran_out_of_memory_is_told_from_other_failures(capsys, tmp_path):
    """`hf-zero3 bench` searches a smaller micro batch only after an out-of-memory failure: the line train prints then,
    torch's own messages (a real failed host allocation here), and not any other error."""
    import traceback

    import torch
    from transformers import AutoConfig, TrainingArguments

    from hf_zero3.run.oom import oom_in_log
    from hf_zero3.run.train import _explain_oom

    config = AutoConfig.from_pretrained(ROOT / "assets/tiny/model")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    _explain_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), config, args, 128)
    assert oom_in_log(capsys.readouterr().err)
    try:
        torch.empty(2**62, dtype=torch.uint8)  # more than any machine has: the allocator refuses it
    except RuntimeError:
        assert oom_in_log(traceback.format_exc())
    else:
        pytest.fail("a 4 EiB allocation succeeded")
    assert not oom_in_log("error: block_size=100000 exceeds the model's max positions (512)\nexit 2")
    assert not oom_in_log("torch.distributed.DistBackendError: NCCL error: unhandled system error")


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
    error_naming(capsys.readouterr().err, "srun", "RANK/WORLD_SIZE")
    assert "WORLD_SIZE" not in __import__("os").environ


def test_push_to_hub_without_a_repo_id_is_a_usage_error_before_training(capsys, tmp_path):
    err = train_fails(capsys, "--push_to_hub", "true", "--output_dir", tmp_path / "o")
    assert "set hub_model_id to ORG/NAME" in err


def train_fails_with(capsys, *args) -> str:
    """main(args) exits 2; its stderr, which must hold no traceback."""
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_every_ds_config_problem_is_reported_at_once_and_nothing_starts(tmp_path, capsys):
    nvme = tmp_path / "nvme"
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "zero_optimisation": {"stage": 3},
        "zero_optimization": {"stage": 3, "sub_group_size": "auto",
                              "offload_param": {"device": "nvme", "nvme_path": str(nvme)}},
        "fp16": {"enabled": True}, "bf16": {"enabled": True},
        "train_batch_size": 64,
    }))
    out = tmp_path / "out"
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", config, "--output_dir", out)
    where = f"error: ds_config {config}: "
    error_naming(err, where + "zero_optimisation:", "'zero_optimization'")
    error_naming(err, where + "zero_optimization.sub_group_size:", "'auto'", "filled by nobody")
    error_naming(err, where + "train_batch_size: 64", "train_batch_size to 8", "'auto'")
    error_naming(err, where + "fp16.enabled:", "bf16", "keep one")
    error_naming(err, where + "zero_optimization.offload_param.nvme_path:", str(nvme), "create it")
    assert not nvme.exists()  # DeepSpeed's swapper would have created it (os.makedirs), then died in async_io
    assert not out.exists()


def test_ds_config_is_checked_against_the_training_arguments(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
                                  "fp16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": 4}))
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", config, "--bf16", "true", "--fp16", "true",
                           "--per_device_train_batch_size", "0", "--output_dir", tmp_path / "o")
    error_naming(err, "error: fp16", "CPU", "drop --fp16", "--bf16 true")
    error_naming(err, "fp16.enabled:", "bf16", "both")
    error_naming(err, "train_micro_batch_size_per_gpu:", "4", "per_device_train_batch_size is 0")
    error_naming(err, "per_device_train_batch_size:", ">= 1", "got 0")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, names", [
    (None, ["not found", "DeepSpeed JSON config"]),
    ('{\n  "zero_optimization": {"stage": 3,}\n}', ["not valid JSON", "line 2, column 36"]),
    ("unreadable", ["Permission denied", "fix its permissions"]),
], ids=["missing", "invalid JSON", "unreadable"])
def test_a_bad_ds_config_file_is_named_with_the_problem(tmp_path, capsys, unreadable, content, names):
    config = unreadable("ds.json") if content == "unreadable" else tmp_path / "ds.json"
    if content not in (None, "unreadable"):
        config.write_text(content)
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", config, "--output_dir", tmp_path / "o")
    error_naming(err, str(config), *names)
    assert not (tmp_path / "o").exists()


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    config = tmp_path / "args.yaml"
    config.write_text("block_size: 128\nmax_steps: 3\n  learning_rate: 1.0e-3\n")
    err = train_fails_with(capsys, config)
    error_naming(err, f"error: {config}:3:16:", "invalid YAML", "fix the YAML")


@pytest.mark.parametrize("key", ["yaml", "train_file", "validation_file", "config_name"])
def test_an_unreadable_input_is_named_with_the_fix(tmp_path, capsys, unreadable, key):
    out = tmp_path / "out"
    if key == "yaml":
        path = unreadable("args.yaml")
        err = train_fails_with(capsys, path, "--output_dir", out)
    elif key == "config_name":
        model = tmp_path / "model"
        shutil.copytree(ROOT / "assets/tiny/model", model)
        (model / "config.json").unlink()
        path = unreadable("model/config.json")
        err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--config_name", model,
                               "--output_dir", out)
    else:
        path = unreadable(f"{key}.txt")
        err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", f"--{key}", path, "--output_dir", out)
    assert f"{path}" in err and "cannot be read (Permission denied)" in err and "fix its permissions" in err
    assert not out.exists()


def test_model_folder_without_config_json_or_weights(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "assets/tiny/model", model)
    (model / "config.json").unlink()
    out = tmp_path / "out"
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--config_name", model, "--output_dir", out)
    error_naming(err, f"config_name {model}", "no config.json", "save_pretrained")
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--config_name", "null",
                           "--model_name_or_path", ROOT / "assets/tiny/model", "--output_dir", out)
    assert "has a config.json but no weights (model.safetensors" in err and "pass it as config_name" in err
    assert not out.exists()


def test_pretrained_weights_with_config_overrides_are_refused(tmp_path, capsys):
    """Overrides would reshape the pretrained config, loading the weights into a model of another size."""
    out = tmp_path / "out"
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--model_name_or_path", "org/some-model",
                           "--config_overrides", "num_hidden_layers=48", "--output_dir", out)
    error_naming(err, "config_overrides (num_hidden_layers=48)", "from scratch", "config_overrides null")
    assert not out.exists()


def test_all_input_problems_are_reported_together(tmp_path, capsys):
    err = train_fails_with(capsys, TINY_YAML, "--train_file", "no/such/train.txt", "--validation_file",
                           tmp_path, "--tokenizer_name", tmp_path, "--output_dir", tmp_path / "out")
    assert "error: train_file 'no/such/train.txt' does not exist" in err
    error_naming(err, f"error: validation_file {str(tmp_path)!r}", "unsupported extension")
    assert f"error: tokenizer_name {tmp_path} holds no tokenizer" in err


def _process_group_threads() -> set[str]:
    """Thread ids of this process's gloo and TCPStore threads (ids: an earlier in-process run may have left its own)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() in {"pt_gloo_runloop", "gloo_tcp_loop",
                                                                          "pt_tcpstore_uv"}:
                found.add(tid)
    return found


def test_an_error_after_the_process_group_started_tears_it_down_and_joins_its_threads(tmp_path, capsys):
    """The cause of the exit-134 aborts: gloo and TCPStore threads still running while the interpreter exits."""
    import torch.distributed as dist

    before = _process_group_threads()
    short = tmp_path / "short.txt"
    short.write_text("Too short for one block.\n")  # found only once tokenized, after the process group started
    err = train_fails_with(capsys, TINY_YAML, "--train_file", short, "--validation_file", "null",
                           "--output_dir", tmp_path / "o")
    assert "fewer than one block (block_size=" in err
    assert not dist.is_initialized()
    assert not _process_group_threads() - before


def test_training_arguments_own_checks_are_usage_errors(tmp_path, capsys):
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--eval_strategy", "sometimes",
                           "--output_dir", tmp_path / "o")
    error_naming(err, "error: bad arguments", "sometimes", "IntervalStrategy", "'no', 'steps', 'epoch'")
    assert not (tmp_path / "o").exists()


def _python(script: str):
    """Run `script` in a fresh interpreter from the repository root (exit_process ends the process it runs in)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_exit_process_does_what_a_normal_exit_does_for_python_then_exits_with_the_code(tmp_path):
    """The entry scripts end with `exit_process`: a thread still writing (a Hub push) finishes, atexit functions run,
    buffered output is flushed, and the code is the run's, whatever the C++ teardown would have done."""
    done = tmp_path / "written"
    script = (
        "import atexit, sys, threading, time\n"
        "from hf_zero3.job.distributed import exit_process\n"
        f"t = threading.Thread(target=lambda: (time.sleep(0.5), open({str(done)!r}, 'w').write('ok')))\n"
        "t.start()\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "sys.stdout.write('buffered, no newline')\n"
        "exit_process(3)\n"
        "print('never')\n")
    proc = _python(script)
    assert proc.returncode == 3, proc.stderr
    assert done.read_text() == "ok"
    assert proc.stdout == "buffered, no newlineatexit ran\n"


def test_exit_process_wakes_an_executor_left_open_as_a_normal_exit_does(tmp_path):
    """A ThreadPoolExecutor never shut down (huggingface_hub's run_as_future keeps one) has idle non-daemon workers:
    joining them without waking them would hang the finished run for ever."""
    proc = _python("from concurrent.futures import ThreadPoolExecutor\n"
                   "from hf_zero3.job.distributed import exit_process\n"
                   "pool = ThreadPoolExecutor(1)\n"
                   "pool.submit(lambda: 1).result()\n"
                   "exit_process(0)\n")
    assert proc.returncode == 0, proc.stderr


def test_a_finished_run_without_checkpoints_is_not_trained_over_from_scratch(capsys, tmp_path):
    """Raising max_steps on a finished run whose checkpoints are gone would restart from step 0 and overwrite its
    final model: refused, with the two ways on."""
    from hf_zero3.checkpoint import lifecycle as ckpt

    out = tmp_path / "done"
    ckpt.claim_output_dir(out)
    (out / "model.safetensors").write_bytes(b"the final weights")
    ckpt.write_finished(out, {"global_step": 8, "max_steps": 8})
    err = train_fails(capsys, "--output_dir", out, "--resume_from_checkpoint", "auto", "--max_steps", "16")
    error_naming(err, "finished run", "step 8", f"--model_name_or_path {out}", "--overwrite_output_dir true")
    assert (out / "model.safetensors").read_bytes() == b"the final weights"
    assert ckpt.read_finished(out)["global_step"] == 8


def test_finishing_from_a_checkpoint_copies_its_files_so_later_writes_leave_it_whole(tmp_path):
    """The final model taken from a checkpoint at max_steps must not share files with it: the Trainer rewrites
    output_dir's trainer_state.json and weights in place when the run is continued."""
    from transformers import TrainingArguments

    from hf_zero3.checkpoint import lifecycle as ckpt
    from hf_zero3.run.start import finish_from
    from tests.conftest import make_checkpoint

    ckpt.claim_output_dir(tmp_path)
    folder = make_checkpoint(tmp_path, 8)
    finish_from(folder, tmp_path, TrainingArguments(output_dir=str(tmp_path), max_steps=8, report_to=[]))
    for name in ("trainer_state.json", "model.safetensors", "config.json"):
        assert not (tmp_path / name).samefile(folder / name), name
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 16, "log_history": []}))
    assert ckpt.verify_complete(folder) == [] and ckpt.is_complete(folder)


def _good_10_and_corrupted_20(tmp_path):
    """checkpoint-10 complete, checkpoint-20 with a shard whose checksum no longer matches; returns checkpoint-20."""
    from hf_zero3.checkpoint import lifecycle as ckpt
    from tests.conftest import make_checkpoint

    ckpt.claim_output_dir(tmp_path)
    make_checkpoint(tmp_path, 10, world_size=1)
    bad = make_checkpoint(tmp_path, 20, world_size=1)
    shard = bad / "global_step20/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(bytes(64))
    return bad


def test_resuming_past_a_corrupted_checkpoint_records_it_so_rotation_never_keeps_it(tmp_path):
    """resume auto skips checkpoint-20 (a checksum differs) and resumes from 10; the run goes on, so 20 is recorded
    as damaged: the new checkpoints (14, 21, 28) then count for keep-last-N, and 20 is never deleted."""
    from transformers import TrainingArguments

    from hf_zero3.checkpoint import lifecycle as ckpt
    from hf_zero3.run.start import start_point
    bad = _good_10_and_corrupted_20(tmp_path)
    args = TrainingArguments(output_dir=str(tmp_path), resume_from_checkpoint="auto", max_steps=30,
                             save_strategy="steps", save_steps=7, report_to=[])
    assert start_point(args) == str(tmp_path / "checkpoint-10")
    assert "is corrupted" in json.loads((bad / ckpt.FAILED).read_text())["problems"]
    assert ckpt.complete_checkpoints(tmp_path) == [tmp_path / "checkpoint-10"]


def test_a_run_past_max_steps_with_a_corrupted_newer_checkpoint_finishes_from_the_good_one(tmp_path):
    """resume auto skips checkpoint-20 (a checksum differs); checkpoint-10 is at max_steps, so the run is finished
    from it (its model copied into output_dir) and 20 stays for the user."""
    from transformers import TrainingArguments

    from hf_zero3.checkpoint import lifecycle as ckpt
    from hf_zero3.run.start import FINISHED, start_point
    bad = _good_10_and_corrupted_20(tmp_path)
    args = TrainingArguments(output_dir=str(tmp_path), resume_from_checkpoint="auto", max_steps=10,
                             save_strategy="steps", save_steps=5, report_to=[])
    assert start_point(args) == FINISHED
    assert ckpt.read_finished(tmp_path)["global_step"] == 10 and bad.is_dir()


def test_a_run_that_stopped_on_bad_input_does_not_lock_its_output_dir(capsys, tmp_path):
    """The first run fails after it claimed output_dir (a bad config_overrides key); the fixed command starts."""
    out = tmp_path / "o"
    err = train_fails(capsys, "--output_dir", out, "--config_overrides", "num_hidden_layer=2")
    error_naming(err, "config_overrides 'num_hidden_layer=2'", "num_hidden_layer isn't in")
    assert "Traceback" not in err
    assert main([str(TINY_YAML), "--deepspeed", "null", "--max_steps", "1", "--output_dir", str(out),
                 "--save_strategy", "no"]) == 0


def test_an_unknown_attention_kernel_is_a_usage_error(capsys, tmp_path):
    err = train_fails(capsys, "--output_dir", tmp_path / "o", "--attn_implementation", "eagr")
    assert err.startswith("error: could not build the model of") and "eagr" in err


def test_nothing_to_train_is_refused_before_anything_starts(capsys, tmp_path):
    out = tmp_path / "o"
    assert main([str(TINY_YAML), "--deepspeed", "null", "--max_steps", "0", "--num_train_epochs", "0",
                 "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nothing to train: max_steps is 0 and num_train_epochs is 0" in err and "set max_steps" in err
    assert not out.exists()


@pytest.mark.parametrize("value, message", [("SIGTERM,SIGUSR9", "'SIGUSR9' is not a signal name"),
                                            ("KILL", "SIGKILL cannot be caught")])
def test_a_preemption_signal_that_cannot_work_is_a_usage_error(capsys, tmp_path, value, message):
    err = train_fails(capsys, "--preemption_signals", value, "--output_dir", tmp_path / "o")
    assert f"preemption_signals: {message}" in err and "SIGTERM,SIGUSR1" in err
    assert not (tmp_path / "o").exists()


def test_preemption_signal_names_and_the_launchers_view_of_them(tmp_path):
    import signal

    from hf_zero3.job.preemption import parse_signals, signals_of_argv

    assert parse_signals("SIGTERM, usr1,SIGTERM") == [signal.SIGTERM, signal.SIGUSR1]
    assert parse_signals("none") == parse_signals("") == []
    config = tmp_path / "args.yaml"
    config.write_text("preemption_signals: SIGUSR2\n")
    assert signals_of_argv([str(config)]) == [signal.SIGUSR2]
    assert signals_of_argv([str(config), "--preemption_signals", "none"]) == []
    assert signals_of_argv([str(TINY_YAML), "--preemption_signals=SIGHUP"]) == [signal.SIGHUP]
    assert signals_of_argv([str(TINY_YAML)]) == [signal.SIGTERM, signal.SIGUSR1]  # the default


FAKE_PER_NODE_LAUNCHER = """
import signal, subprocess, sys
rank = ("import signal, sys, time; time.sleep(2); "
        "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('caught'), sys.exit(0))); "
        "time.sleep(60)")
sys.exit(subprocess.call([sys.executable, \"-c\", rank, sys.argv[-1]]))
"""


def test_a_signal_for_another_node_is_held_until_its_ranks_can_take_it(tmp_path):
    """`remote_command` (what pdsh runs on each node) sent before a node's launcher and rank are up, and before the
    rank installs its handler: it waits, and the rank catches the signal instead of dying of it or missing it."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from hf_zero3.job.distributed import free_port
    from hf_zero3.job.preemption import remote_command

    package = tmp_path / "fake" / "deepspeed" / "launcher"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "launch.py").write_text(FAKE_PER_NODE_LAUNCHER)
    port, caught = str(free_port()), tmp_path / "caught"
    holder = subprocess.Popen(["bash", "-c", remote_command(signal.SIGTERM, port)])
    launcher = subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--master_port={port}",
                                 str(caught)], env={**os.environ, "PYTHONPATH": str(tmp_path / "fake")})
    try:
        assert launcher.wait(timeout=30) == 0 and caught.read_text() == "caught"
        assert holder.wait(timeout=10) == 0
        late = subprocess.Popen(["bash", "-c", remote_command(signal.SIGTERM, port)])  # the node's job is over
        launcher = subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.launch",
                                     f"--master_port={port}", str(tmp_path / "never")],
                                    env={**os.environ, "PYTHONPATH": str(tmp_path / "fake")})
        time.sleep(1)
        for process in [*psutil.Process(launcher.pid).children(), psutil.Process(launcher.pid)]:
            process.kill()  # the job ends before its rank has a handler: the hold gives up, not after 600 s
        assert late.wait(timeout=10) == 0
    finally:
        for process in (holder, launcher):
            process.kill()


@pytest.mark.parametrize("signals, stop", [("SIGTERM,SIGUSR1", "SIGINT"), ("SIGINT,SIGUSR1", "SIGTERM")])
def test_the_signal_that_stops_a_job_is_one_not_blocked_for_preemption(signals, stop):
    import signal

    from hf_zero3.job.preemption import _stop_signal, parse_signals

    assert _stop_signal(parse_signals(signals)) == signal.Signals[stop]


def test_resuming_a_checkpoint_of_another_shape_names_both_shapes_before_the_load(capsys, tmp_path):
    from hf_zero3.checkpoint import lifecycle as ckpt
    from tests.conftest import make_checkpoint

    out = tmp_path / "run"
    ckpt.claim_output_dir(out)
    folder = make_checkpoint(out, 2, world_size=1, marked=False)
    saved = json.loads((ROOT / "assets/tiny/model/config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "hidden_size": 256, "num_hidden_layers": 8}))
    ckpt.write_marker(folder, {"world_size": 1}, hashes=ckpt.hash_files(folder))
    err = train_fails(capsys, "--output_dir", out, "--resume_from_checkpoint", "auto", "--max_steps", "4")
    assert f"{folder} holds a model of another shape than this run's" in err
    error_naming(err, "hidden_size 256 (checkpoint) vs 128", "num_hidden_layers 8 (checkpoint) vs 4")
    assert "Resume with the model it was saved from" in err and "another output_dir" in err
    assert "Traceback" not in err


def _lora_checkpoint(folder: Path) -> None:
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                            "target_modules": ["q_proj", "v_proj"]}))


def _full_checkpoint(folder: Path) -> None:
    (folder / "config.json").write_text((ROOT / "assets/tiny/model/config.json").read_text())


@pytest.mark.parametrize("saved_as, marker, run_with, names", [
    (_lora_checkpoint, {}, ["--deepspeed", "null"],
     ["a LoRA adapter's checkpoint", "'r': 4", "this run has no peft: block", "resume it with the peft: block"]),
    (_full_checkpoint, {}, ["--deepspeed", "null", "--peft", "{r: 4, lora_alpha: 8, target_modules: [q_proj]}"],
     ["a full fine-tune's checkpoint", "this run has a peft: block", "--peft null"]),
    (_full_checkpoint, {"ds_config": {"zero_optimization": {"stage": 2}}},
     ["--deepspeed", ROOT / "recipes/tiny/ds_config.json"],
     ["saved by ZeRO stage 2", "this run's ds_config has stage 3", "a ds_config of stage 2", "hf-zero3 reshard"]),
])
def test_a_resume_that_does_not_match_how_the_checkpoint_was_trained_stops_before_anything_loads(
        capsys, tmp_path, saved_as, marker, run_with, names):
    """Full or adapter, and the ZeRO stage, read from the checkpoint's own files before the process group: one line
    naming both sides and the fix; nothing in output_dir changes."""
    from hf_zero3.checkpoint import lifecycle as ckpt
    from tests.conftest import make_checkpoint

    out = tmp_path / "run"
    ckpt.claim_output_dir(out)
    folder = make_checkpoint(out, 2, world_size=1, marked=False)
    saved_as(folder)
    ckpt.write_marker(folder, {"world_size": 1, **marker}, hashes=ckpt.hash_files(folder))
    before = sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*"))
    err = train_fails_with(capsys, TINY_YAML, *run_with, "--output_dir", out, "--resume_from_checkpoint", "auto",
                           "--max_steps", "4")
    error_naming(err, "resume_from_checkpoint", str(folder), *names)
    assert sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def _chat_file(tmp_path: Path, tools: str) -> Path:
    path = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": turns, "tools": tools}) + "\n")
    return path


@pytest.mark.parametrize("where, overrides, names", [
    ("override", ["--peft", "{r: 8, lora_alpha: 16"], ["--peft:1:", "invalid YAML", "every { and [ closed"]),
    ("override", ["--gradient_checkpointing_kwargs", "{use_reentrant: false"],
     ["--gradient_checkpointing_kwargs:1:", "invalid YAML", "every { and [ closed"]),
    ("override", ["--peft", "[r: 8"], ["--peft:1:", "invalid YAML", "in quotes"]),
    ("column", ['[{"type": "function", "function": {"name": "f"'],
     ["line 2 its tools column:1:", "invalid JSON", "JSON list of function schemas"]),
])
def test_json_or_yaml_that_does_not_parse_is_one_line_naming_where_and_the_fix(capsys, tmp_path, where, overrides,
                                                                                names):
    """Whatever JSON or YAML text a user hands us, an override or a data column, fails one way: the source, the line
    and column, what the parser found, and the fix; before anything starts, nothing written."""
    out = tmp_path / "o"
    if where == "column":
        overrides = ["--train_file", _chat_file(tmp_path, overrides[0]), "--validation_file", "null"]
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--output_dir", out, *overrides)
    error_naming(err, names[0], *names[1:])
    assert not out.exists()


@pytest.mark.parametrize("model, overrides, names", [
    ("mixtral", "num_experts_per_tok=6", ["num_experts_per_tok is 6", "num_local_experts 4", "at most 4"]),
    ("model", "num_key_value_heads=3", ["num_attention_heads 4", "num_key_value_heads 3", "a divisor of 4"]),
    ("model", "num_hidden_layers=0", ["num_hidden_layers is 0", "1 or more"]),
    ("model", "pad_token_id=2000", ["pad_token_id 2000 is outside the vocabulary", "below 1024"]),
])
def test_a_model_config_its_forward_would_trip_on_stops_before_anything_starts(capsys, tmp_path, model, overrides,
                                                                                names):
    """Fields transformers builds a model from but whose first forward fails (or whose embedding cannot be made):
    one line naming the config, the field and the fix, before the process group; nothing written."""
    out = tmp_path / "o"
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--output_dir", out, "--model_name_or_path",
                           "null", "--config_name", ROOT / "assets/tiny" / model, "--config_overrides", overrides)
    error_naming(err, "model config of", *names)
    assert not out.exists()


@pytest.mark.parametrize("argv, expected", [
    (["--leaf_modules", "MixtralSparseMoeBlock", "MixtralExperts"], {"leaf_modules": ["MixtralSparseMoeBlock",
                                                                                       "MixtralExperts"]}),
    (["--leaf_modules", "MixtralSparseMoeBlock"], {"leaf_modules": ["MixtralSparseMoeBlock"]}),
    (["--leaf_modules", "[A, B]", "--max_steps", "3"], {"leaf_modules": ["A", "B"], "max_steps": 3}),
    (["--leaf_modules", "null"], {"leaf_modules": None}),
    (["--label_names", "labels"], {"label_names": ["labels"]}),
    (["--report_to", "wandb", "tensorboard"], {"report_to": ["wandb", "tensorboard"]}),
    (["--report_to", "none"], {"report_to": "none"}),
])
def test_a_list_field_takes_one_name_several_words_or_a_yaml_list(argv, expected):
    """The command-line forms the docs show for a list (`--leaf_modules A B`, `--leaf_modules A`) and a YAML list
    all give the list: one name is never split into its characters."""
    assert load_arguments(argv) == expected


def test_several_words_for_a_one_value_field_name_the_field_and_the_fix():
    with pytest.raises(UsageError) as e:
        load_arguments(["--max_steps", "3", "4"])
    error_naming(str(e.value), "max_steps takes one value", "3 4", "quote a value")


def _export_merge_of_a_deleted_base(capsys, tmp_path):
    from hf_zero3.checkpoint import lifecycle as ckpt
    from hf_zero3.cli import main as cli

    folder = tmp_path / "adapter"
    folder.mkdir()
    _lora_checkpoint(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    base = tmp_path / "deleted-base"
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    ckpt.write_finished(folder, {"global_step": 2})
    assert cli(["export", str(folder), str(tmp_path / "merged"), "--merge"]) != 0
    captured = capsys.readouterr()
    assert not (tmp_path / "merged").exists()
    return captured.out + captured.err


def _chat_template_that_does_not_parse(capsys, tmp_path):
    out = tmp_path / "o"
    err = train_fails_with(capsys, TINY_YAML, "--deepspeed", "null", "--output_dir", out, "--train_file",
                           _chat_file(tmp_path, "[]"), "--validation_file", "null", "--chat_template",
                           "{% for m in messages %}{{ m.content }{% endfor %}")
    assert not out.exists()
    return err


@pytest.mark.parametrize("case, names, not_said", [
    (_export_merge_of_a_deleted_base, ["deleted-base", "base_model_name_or_path", "not there", "--base MODEL"],
     "Repo id"),
    (_chat_template_that_does_not_parse, ["the chat template does not parse", "line 1", "Fix the template",
                                          "chat_template"], "Fix the row"),
])
def test_a_message_names_the_input_at_fault_not_another(capsys, tmp_path, case, names, not_said):
    """A base folder deleted under an adapter is not a malformed hub id; a template that does not parse is not a
    bad row."""
    said = case(capsys, tmp_path)
    error_naming(said, names[0], *names[1:])
    assert not_said not in said


def test_bad_chat_rows_stop_train_before_the_process_group_with_every_row_named(tmp_path, capsys):
    """What `hf-zero3 train` says about a chat file with an unknown role, non-string content and no assistant turn:
    all of it at once, nothing written, no process group."""
    import torch.distributed as dist

    path = tmp_path / "chat.jsonl"
    rows = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}],
            [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}],
            [{"role": "user", "content": "only a question"}]]
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    out = tmp_path / "out"
    err = train_fails_with(capsys, TINY_YAML, "--train_file", path, "--validation_file", "null", "--output_dir", out)
    for needle in ("line 2", "role 'bot'", "line 3", "content of type int", "line 4", "no assistant turn",
                   "train_on_inputs"):
        assert needle in err, err
    assert not dist.is_initialized() and not out.exists()


def test_regional_compile_refuses_whole_model_compile_and_an_unknown_backend(capsys, tmp_path):
    err = train_fails(capsys, "--regional_compile", "true", "--torch_compile", "true", "--regional_compile_backend",
                      "tensorrt", "--output_dir", tmp_path / "out")
    assert "regional_compile and torch_compile both compile" in err and "set one of them" in err
    error_naming(err, "regional_compile_backend 'tensorrt'", "inductor, aot_eager, eager")
    assert not (tmp_path / "out").exists()


def test_regional_compile_needs_decoder_layers():
    import torch

    from hf_zero3.model.regional_compile import enable

    with pytest.raises(ValueError) as err:
        enable(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    error_naming(str(err.value), "Sequential", "GradientCheckpointingLayer", "drop it")


def test_fp8_without_regional_compile_is_refused_before_anything_starts(capsys, tmp_path):
    err = train_fails(capsys, "--fp8", "true", "--fp8_recipe", "delayed", "--output_dir", tmp_path / "out")
    error_naming(err, "fp8 needs regional_compile", "set regional_compile true")
    error_naming(err, "fp8_recipe 'delayed'", "tensorwise")
    assert not (tmp_path / "out").exists()


def test_liger_with_compiled_layers_stays_out_of_them_unless_its_config_says_otherwise():
    from types import SimpleNamespace

    from hf_zero3.model.prepare import _liger_outside_compiled_layers
    from hf_zero3.model.regional_compile import LIGER_OUTSIDE_LAYERS

    args = SimpleNamespace(regional_compile=True, use_liger_kernel=True, liger_kernel_config=None)
    _liger_outside_compiled_layers(args)
    assert args.liger_kernel_config == LIGER_OUTSIDE_LAYERS
    assert not any(LIGER_OUTSIDE_LAYERS.values())  # TRL's SFTTrainer refuses Liger's fused cross-entropy
    chosen = SimpleNamespace(regional_compile=True, use_liger_kernel=True, liger_kernel_config={"rms_norm": True})
    uncompiled = SimpleNamespace(regional_compile=False, use_liger_kernel=True, liger_kernel_config=None)
    for left in (chosen, uncompiled):
        before = dict(left.__dict__)
        _liger_outside_compiled_layers(left)
        assert left.__dict__ == before
