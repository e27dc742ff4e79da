"""Issue 11's proof: every user mistake gets a clear error before anything starts, and nothing on disk changes.

One table of bad inputs across every verb and entry point. Each row asserts:
- the exit status (2 for usage errors, 1 where a verb reports findings: `config check`, a doctor FAIL, a dry run);
- that the stream the verb reports on names the problem and the fix (a few words each, case-insensitive);
  usage errors go to stderr; `config check` findings, doctor FAIL lines and dry-run findings go to stdout;
- no "Traceback" in stdout or stderr;
- the sentinel (a real tiny run with two complete checkpoints and an export inside it) is byte-identical afterwards
  (a digest of every file and folder under it), and a fresh path the row may name ({N}) stays empty.

Where the entry point does not matter a row runs in-process (`hf_zero3.cli.main`); train, launch.sh and a few
console-script rows run as subprocesses, a few at a time. A row that changed the sentinel is named with the rows
that ran beside it, and the sentinel is restored; BAD_INPUT_WORKERS=1 runs the subprocess rows one by one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hf_zero3.cli import main as cli_main
from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, make_unreadable, run, subprocess_env

pytestmark = pytest.mark.integration

WORKERS = int(os.environ.get("BAD_INPUT_WORKERS", "3"))
"""Subprocess rows at once: they spend most of their time importing, so 3 keep 2 cores busy."""
SKIPS = ("--skip", "versions", "--skip", "native", "--skip", "gpus", "--skip", "ops", "--skip", "allreduce")
"""Doctor groups a row does not need (the all-reduce starts ranks): only the check under test runs."""
TRAIN = ("hf-zero3", "train", str(TINY_YAML))
SHORT = ("--max_steps", "4", "--save_steps", "2", "--validation_file", "null")
"""Train rows stay short even if a bad input were not caught."""
LAUNCH = ("recipes/tiny/launch.sh",)


@dataclass(frozen=True)
class Row:
    """One bad input. `argv` may hold {S} (the sentinel run), {I} (the inputs folder), {N} (a fresh path that must
    stay unused) and {PORT} (a closed localhost port)."""

    id: str
    argv: tuple[str, ...]
    problem: tuple[str, ...]
    fix: tuple[str, ...]
    rc: int = 2
    stream: str = "err"
    proc: bool = False
    """A subprocess: argv[0] is `hf-zero3`, `python` (this interpreter) or a path under the repository."""
    env: dict = field(default_factory=dict)
    """Environment for the row; None unsets a variable."""
    absent: tuple[str, ...] = ()
    """Paths that must not exist afterwards (e.g. an NVMe path that must not be created)."""


def cli(id, argv, problem, fix, **kw) -> Row:
    return Row(id, tuple(argv.split()) if isinstance(argv, str) else tuple(argv), tuple(problem), tuple(fix), **kw)


def sub(id, argv, problem, fix, **kw) -> Row:
    return cli(id, argv, problem, fix, proc=True, **kw)


# --- config check: findings on stdout, exit 1; argparse errors on stderr, exit 2 ----------------------------------
CONFIG_CHECK = [
    cli("check-missing-file", "config check {I}/no_such.json", ["no_such.json", "not found"], ["pass the path"],
        rc=1, stream="out"),
    cli("check-trailing-comma", "config check {I}/trailing_comma.json", ["not valid JSON"], ["line 1, column 35"],
        rc=1, stream="out"),
    cli("check-empty-file", "config check {I}/empty.json", ["empty.json", "not valid JSON"], ["line 1, column 1"],
        rc=1, stream="out"),
    cli("check-top-level-list", "config check {I}/list.json", ["not list"], ["must hold a JSON object"],
        rc=1, stream="out"),
    cli("check-binary-file", "config check {I}/binary.json", ["binary.json", "not"], ["JSON"], rc=1, stream="out"),
    cli("check-unreadable-file", "config check {I}/unreadable.json", ["unreadable.json", "cannot be read"],
        ["permissions"], rc=1, stream="out"),
    cli("check-a-folder", "config check {S}", ["{S} is a folder"], ["JSON file"], rc=1, stream="out"),
    cli("check-model-config-json", "config check {S}/config.json", ["architectures", "unknown top-level key"],
        ["Remove or rename it"], rc=1, stream="out"),
    cli("check-misspelt-zero-block", "config check {I}/typo_top.json", ["zero_optimisation"],
        ["did you mean 'zero_optimization'"], rc=1, stream="out"),
    cli("check-misspelt-zero-key", "config check {I}/typo_zero.json", ["stage3_prefetch_bucket_sise"],
        ["did you mean", "stage3_prefetch_bucket_size"], rc=1, stream="out"),
    cli("check-stage-4", "config check {I}/stage4.json", ["stage", "got 4"], ["0, 1, 2 or 3"], rc=1, stream="out"),
    cli("check-zero-block-a-string", "config check {I}/zero_string.json", ["zero_optimization", "'three'"],
        ["must be a JSON object"], rc=1, stream="out"),
    cli("check-train-batch-0", "config check {I}/tbs0.json", ["train_batch_size", "got 0"], ["set a value > 0"],
        rc=1, stream="out"),
    cli("check-micro-batch-negative", "config check {I}/micro_negative.json",
        ["train_micro_batch_size_per_gpu", "got -1"], ["set a value > 0"], rc=1, stream="out"),
    cli("check-fp16-and-bf16", "config check {I}/fp16_bf16.json", ["fp16 and bf16 are both enabled"], ["keep one"],
        rc=1, stream="out"),
    cli("check-bfloat16-and-bf16", "config check {I}/bfloat16_bf16.json", ["old alias 'bfloat16'"],
        ["Remove the 'bfloat16' block"], rc=1, stream="out"),
    cli("check-unfilled-auto", "config check {I}/auto.json", ["sub_group_size", "'auto'"], ["explicit value"],
        rc=1, stream="out"),
    cli("check-nvme-path-missing", "config check {I}/nvme_missing.json", ["no_such_nvme", "does not exist"],
        ["mkdir -p"], rc=1, stream="out", absent=("{I}/no_such_nvme",)),
    cli("check-nvme-without-path", "config check {I}/nvme_no_path.json", ["needs nvme_path"],
        ["directory on a fast local NVMe mount"], rc=1, stream="out"),
    cli("check-param-offload-stage-2", "config check {I}/offload_stage2.json", ["offload_param", "stage is 2"],
        ["set zero_optimization.stage to 3"], rc=1, stream="out"),
    cli("check-offload-without-optimizer", "config check {I}/offload_no_optimizer.json", ["no optimizer block"],
        ['Add {"optimizer"'], rc=1, stream="out"),
    cli("check-batch-math-world-size", "config check {I}/batch16.json --world-size 2", ["16 != micro batch 4"],
        ["set train_batch_size to 8"], rc=1, stream="out"),
    cli("check-micro-batch-flag-disagrees", "config check {I}/batch16.json --micro-batch 2",
        ["says 4 but --micro-batch is 2"], ["make them equal"], rc=1, stream="out"),
    cli("check-fp16-on-cpu", "config check {I}/fp16.json --device cpu", ["fp16 is not supported on CPU"],
        ["set fp16.enabled"], rc=1, stream="out"),
    cli("check-clipping-negative", "config check {I}/clip_negative.json", ["gradient_clipping", "got -1"],
        [">= 0"], rc=1, stream="out"),
    cli("check-world-size-0", "config check {I}/stage4.json --world-size 0", ["--world-size", "'0'"],
        ["positive integer"]),
    cli("check-device-tpu", "config check {I}/stage4.json --device tpu", ["--device", "'tpu'"], ["choose from"]),
]

# --- config new: stderr, exit 2 -------------------------------------------------------------------------------------
CONFIG_NEW = [
    cli("new-like-missing-file", "config new --like {I}/no_such.json", ["no_such.json", "not found"],
        ["pass the path"]),
    cli("new-like-trailing-comma", "config new --like {I}/trailing_comma.json", ["not valid JSON"],
        ["line 1, column 35", "hf-zero3 config check"]),
    cli("new-like-stage-4", "config new --like {I}/stage4.json", ["stage", "less than or equal to 3", "got 4"],
        ["hf-zero3 config check"]),
    cli("new-like-unreadable", "config new --like {I}/unreadable.json", ["unreadable.json", "cannot be read"],
        ["permissions"]),
    cli("new-like-a-folder", "config new --like {S}", ["{S} is a folder"], ["JSON file"]),
    cli("new-stage-5", "config new --stage 5", ["--stage", "5"], ["choose from 0, 1, 2, 3"]),
    cli("new-micro-batch-0", "config new --micro-batch 0", ["--micro-batch", "'0'"], ["positive integer"]),
    cli("new-micro-batch-abc", "config new --micro-batch abc", ["--micro-batch", "abc"],
        ["positive integer or auto"]),
    cli("new-sub-group-0", "config new --sub-group-size 0", ["--sub-group-size", "'0'"], ["positive integer"]),
    cli("new-nvme-without-path", "config new --offload-optimizer nvme", ["nvme", "needs"], ["--nvme-path"]),
    cli("new-preset-unknown", "config new --preset zero4", ["--preset", "'zero4'"], ["choose from"]),
    cli("new-precision-fp8", "config new --precision fp8", ["--precision", "'fp8'"], ["choose from"]),
    cli("new-param-offload-stage-2", "config new --stage 2 --offload-param cpu", ["offload_param needs stage 3"],
        ["set stage 3"]),
    cli("new-clipping-negative", "config new --gradient-clipping -1", ["gradient_clipping", "-1"],
        [">= 0 or 'auto'"]),
    cli("new-global-batch-indivisible", "config new --global-batch 10 --micro-batch 4 --grad-accum 1",
        ["global_batch_size 10 is not a multiple of micro_batch_size 4"], ["make it a multiple of 4"]),
    cli("new-output-a-folder", "config new --preset zero3 -o {S}", ["{S}", "is a folder"], ["file path"]),
    cli("new-output-missing-folder", "config new --preset zero3 -o {N}/sub/ds.json", ["does not exist"],
        ["create it"]),
]

# --- plan: stderr, exit 2 -------------------------------------------------------------------------------------------
HW = "--gpus 1 --gpu-mem 80GB"
PLAN = [
    cli("plan-no-model", f"plan {HW}", ["no model"], ["pass --model"]),
    cli("plan-unknown-model", f"plan --model 99b {HW}", ["unknown model '99b'"], ["use a recipe (", "hub id"]),
    cli("plan-model-missing-folder", f"plan --model {{I}}/no_such_model {HW}", ["no_such_model"],
        ["folder with config.json"]),
    cli("plan-model-folder-without-config", f"plan --model {{S}}/checkpoint-4/global_step4 {HW}",
        ["global_step4"], ["folder with config.json"]),
    cli("plan-model-config-unreadable", f"plan --model {{I}}/unreadable_model {HW}", ["unreadable_model"],
        ["folder with config.json"]),
    cli("plan-model-a-json-file", f"plan --model {{I}}/stage4.json {HW}", ["stage4.json"],
        ["folder with config.json"]),
    cli("plan-gpu-mem-no-unit", "plan --model tiny --gpus 1 --gpu-mem 40", ["--gpu-mem", "'40'"], ["with a unit"]),
    cli("plan-gpu-mem-garbage", "plan --model tiny --gpus 1 --gpu-mem lots", ["--gpu-mem", "'lots'"],
        ["with a unit"]),
    cli("plan-host-ram-garbage", f"plan --model tiny {HW} --host-ram 1XB", ["--host-ram", "'1XB'"], ["with a unit"]),
    cli("plan-gpus-0", "plan --model tiny --gpus 0 --gpu-mem 80GB", ["--gpus", "0"], ["positive integer"]),
    cli("plan-gpus-two", "plan --model tiny --gpus two --gpu-mem 80GB", ["--gpus", "'two'"], ["positive integer"]),
    cli("plan-nodes-negative", f"plan --model tiny --nodes -1 {HW}", ["--nodes", "'-1'"], ["positive integer"]),
    cli("plan-seq-len-0", f"plan --model tiny --seq-len 0 {HW}", ["--seq-len", "'0'"], ["positive integer"]),
    cli("plan-micro-batch-0", f"plan --model tiny --micro-batch 0 {HW}", ["--micro-batch", "'0'"],
        ["positive integer"]),
    cli("plan-precision-fp8", f"plan --model tiny --precision fp8 {HW}", ["--precision", "'fp8'"], ["choose from"]),
    cli("plan-global-batch-indivisible", f"plan --model tiny {HW} --global-batch 7 --micro-batch 2",
        ["micro batch 2 does not divide"], ["use a divisor of 7"]),
    cli("plan-heads-not-multiple-of-kv", f"plan --layers 2 --hidden 64 --ffn 128 --heads 3 --kv-heads 2 "
        f"--vocab 100 {HW}", ["heads (3) must be a multiple of kv_heads (2)"], ["--kv-heads"]),
    cli("plan-layers-0", f"plan --layers 0 --hidden 64 --ffn 128 --heads 4 --vocab 100 {HW}", ["--layers", "'0'"],
        ["positive integer"]),
    cli("plan-nvme-path-missing", f"plan --model tiny {HW} --nvme-path {{I}}/no_such_nvme",
        ["no_such_nvme", "not a directory"], ["--nvme-free"], absent=("{I}/no_such_nvme",)),
    cli("plan-write-config-a-folder", f"plan --model tiny {HW} --write-config {{S}}", ["{S}", "is a folder"],
        ["file path"]),
    cli("plan-write-config-missing-folder", f"plan --model tiny {HW} --write-config {{N}}/sub/ds.json",
        ["does not exist"], ["create it"]),
]

# --- doctor: input problems on stderr, exit 2; a FAIL line on stdout, exit 1 -----------------------------------------
DOCTOR = [
    cli("doctor-config-missing", "doctor --config {I}/no_such.json", ["--config", "not found"], ["pass the path"]),
    cli("doctor-config-trailing-comma", "doctor --config {I}/trailing_comma.json", ["--config", "not valid JSON"],
        ["line 1, column 35"]),
    cli("doctor-config-binary", "doctor --config {I}/binary.json", ["binary.json", "not"], ["JSON"]),
    cli("doctor-config-unreadable", "doctor --config {I}/unreadable.json", ["unreadable.json", "cannot be read"],
        ["permissions"]),
    cli("doctor-config-a-folder", "doctor --config {S}", ["{S} is a folder"], ["JSON file"]),
    cli("doctor-hostfile-missing", "doctor --hostfile {I}/no_such_hostfile", ["no_such_hostfile", "No such file"],
        ["pass a readable DeepSpeed hostfile"]),
    cli("doctor-hostfile-spaces", "doctor --hostfile {I}/hostfile_spaces", ["'localhost slots = 2'"],
        ["write `localhost slots=2`"]),
    cli("doctor-hostfile-duplicate", "doctor --hostfile {I}/hostfile_duplicate", ["listed twice"],
        ["keep one line per host"]),
    cli("doctor-hostfile-no-hosts", "doctor --hostfile {I}/hostfile_comments", ["no hosts"], ["add one line"]),
    cli("doctor-hostfile-slots-a-word", "doctor --hostfile {I}/hostfile_slots_word", ["'localhost slots=two'"],
        ["slots="]),
    cli("doctor-hostfile-unreadable", "doctor --hostfile {I}/unreadable_hostfile", ["unreadable_hostfile",
                                                                                     "cannot read hostfile"],
        ["pass a readable DeepSpeed hostfile"]),
    cli("doctor-hostfile-a-folder", "doctor --hostfile {S}", ["{S}", "Is a directory"],
        ["pass a readable DeepSpeed hostfile"]),
    cli("doctor-ranks-0", "doctor --ranks 0", ["--ranks", "'0'"], ["positive integer"]),
    cli("doctor-ssh-port-70000", "doctor --ssh-port 70000", ["--ssh-port", "70000"], ["port 1..65535"]),
    cli("doctor-skip-unknown-group", "doctor --skip bogus", ["--skip", "'bogus'"], ["choose from"]),
    cli("doctor-launcher-mpirun", "doctor --launcher mpirun", ["--launcher", "'mpirun'"], ["choose from"]),
    cli("doctor-nvme-test-mb-0", "doctor --nvme-test-mb 0", ["--nvme-test-mb", "'0'"], ["positive integer"]),
    cli("doctor-matrix-not-a-requirement", ["doctor", *SKIPS, "--matrix", "torch>=bad"], ["--matrix", "torch>=bad"],
        ["e.g. 'torch>=2.8"]),
    cli("doctor-matrix-not-installed", ["doctor", *SKIPS[2:], "--skip", "nvme", "--matrix", "notapackage>=1"],
        ["notapackage", "not installed"], ["pip install"], rc=1, stream="out"),
    cli("doctor-nvme-path-missing", ["doctor", *SKIPS, "--nvme-path", "{I}/no_such_nvme"],
        ["no_such_nvme", "does not exist"], ["mkdir -p"], rc=1, stream="out", absent=("{I}/no_such_nvme",)),
    cli("doctor-config-nvme-path-missing", ["doctor", *SKIPS, "--config", "{I}/nvme_missing.json"],
        ["no_such_nvme", "does not exist"], ["mkdir -p"], rc=1, stream="out", absent=("{I}/no_such_nvme",)),
    cli("doctor-unknown-op", ["doctor", *SKIPS[:6], *SKIPS[8:], "--skip", "nvme", "--ops", "no_such_op"],
        ["no op 'no_such_op'"], ["use one of"], rc=1, stream="out"),
]

# --- export and reshard: stderr, exit 2 ------------------------------------------------------------------------------
EXPORT = [
    cli("export-missing-checkpoint", "export {I}/no_such_checkpoint {N}", ["no_such_checkpoint", "not a folder"],
        ["checkpoint-N folder"]),
    cli("export-the-output-dir", "export {S} {N}", ["{S} is not a complete checkpoint"], ["{S}/checkpoint-4"]),
    cli("export-an-export", "export {S}/export {N}", ["not a complete checkpoint"], ["checkpoint-N folder"]),
    cli("export-the-tag-folder", "export {S}/checkpoint-4/global_step4 {N}", ["not a complete checkpoint"],
        ["{S}/checkpoint-4"]),
    cli("export-a-file", "export {S}/config.json {N}", ["config.json", "not a folder"], ["checkpoint-N folder"]),
    cli("export-into-the-export", "export {S}/checkpoint-4 {S}/export", ["already exists and is not empty"],
        ["choose a new output folder"]),
    cli("export-into-the-output-dir", "export {S}/checkpoint-4 {S}", ["already exists and is not empty"],
        ["choose a new output folder"]),
    cli("export-into-a-newer-checkpoint", "export {S}/checkpoint-2 {S}/checkpoint-4",
        ["already exists and is not empty"], ["choose a new output folder"]),
    cli("export-onto-a-file", "export {S}/checkpoint-4 {S}/config.json", ["config.json", "already exists"],
        ["choose a new output folder"]),
    cli("export-under-a-file", "export {S}/checkpoint-4 {S}/config.json/out", ["cannot create", "Not a directory"],
        ["choose an output folder you can write to"]),
    cli("export-unwritable-place", "export {S}/checkpoint-4 /proc/hf_zero3_export", ["cannot create"],
        ["choose an output folder you can write to"]),
    cli("export-shard-size-garbage", "export {S}/checkpoint-4 {N} --shard-size garbage",
        ["--shard-size", "'garbage'"], ["with a unit"]),
    cli("export-shard-size-0", "export {S}/checkpoint-4 {N} --shard-size 0GB", ["shard size", "not positive"],
        ["e.g. 5GB"]),
    cli("export-dtype-fp16", "export {S}/checkpoint-4 {N} --dtype fp16", ["--dtype", "'fp16'"], ["choose from"]),
    cli("reshard-missing-checkpoint", "reshard {I}/no_such_checkpoint", ["no_such_checkpoint", "not a folder"],
        ["checkpoint-N folder"]),
    cli("reshard-the-output-dir", "reshard {S}", ["{S} is not a complete checkpoint"], ["{S}/checkpoint-4"]),
    cli("reshard-an-export", "reshard {S}/export", ["not a complete checkpoint"], ["checkpoint-N folder"]),
    cli("reshard-workers-0", "reshard {S}/checkpoint-4 --workers 0", ["--workers", "0"], ["positive integer"]),
    cli("reshard-workers-abc", "reshard {S}/checkpoint-4 --workers abc", ["--workers", "'abc'"],
        ["positive integer"]),
]

# --- push: stderr, exit 2 -------------------------------------------------------------------------------------------
REPO_FIX = ["set --repo-id to ORG/NAME"]
PUSH = [
    cli("push-repo-id-three-parts", "push {S}/export --repo-id a/b/c", ["'a/b/c'", "not ORG/NAME"], REPO_FIX),
    cli("push-repo-id-space", ["push", "{S}/export", "--repo-id", "my org/model"], ["'my org/model'"], REPO_FIX),
    cli("push-repo-id-bangs", "push {S}/export --repo-id !!", ["'!!'", "not ORG/NAME"], REPO_FIX),
    cli("push-repo-id-no-org", "push {S}/export --repo-id model", ["'model'", "not ORG/NAME"], REPO_FIX),
    cli("push-repo-id-double-dash", "push {S}/export --repo-id org/a--b", ["'org/a--b'"], REPO_FIX),
    cli("push-repo-id-missing", "push {S}/export", ["required", "--repo-id"], ["--repo-id REPO_ID"]),
    cli("push-a-checkpoint-tag-folder", "push {S}/checkpoint-4/global_step4 --repo-id org/m",
        ["no model.safetensors"], ["hf-zero3 export"]),
    cli("push-a-missing-folder", "push {I}/no_such_folder --repo-id org/m", ["no_such_folder", "does not exist"],
        ["hf-zero3 export"]),
    cli("push-a-file", "push {S}/config.json --repo-id org/m", ["config.json", "not a folder"], ["hf-zero3 export"]),
    cli("push-config-without-weights", "push {I}/no_weights --repo-id org/m", ["no model.safetensors"],
        ["hf-zero3 export"]),
    cli("push-unreadable-weights", "push {I}/unreadable_weights --repo-id org/m", ["model.safetensors", "unreadable"],
        ["hf-zero3 export"]),
    cli("push-truncated-weights", "push {I}/truncated --repo-id org/m", ["model.safetensors is unreadable"],
        ["hf-zero3 export"]),
    sub("push-connection-refused", "hf-zero3 push {S}/export --repo-id org/m", ["cannot reach", "Connection refused"],
        ["HF_ENDPOINT"], env={"HF_ENDPOINT": "http://127.0.0.1:{PORT}", "HF_TOKEN": "hf_not_a_token",
                              "HF_HUB_OFFLINE": None, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1"}),
    sub("push-offline", "hf-zero3 push {S}/export --repo-id org/m", ["HF_HUB_OFFLINE"], ["unset it"],
        env={"HF_HUB_OFFLINE": "1"}),
]

# --- train: hf-zero3 train (one process), python train.py, python -m hf_zero3.train; stderr, exit 2 -----------------
TRAIN_ROWS = [
    sub("train-into-the-sentinel", [*TRAIN, "--output_dir", "{S}", *SHORT], ["{S} already holds a run"],
        ["--resume_from_checkpoint auto", "--overwrite_output_dir"]),
    sub("train-overwrite-the-sentinel", [*TRAIN, "--output_dir", "{S}", "--overwrite_output_dir", "true", *SHORT],
        ["holds checkpoints of an earlier run", "checkpoint-2"], ["Move or delete them"]),
    sub("train-resume-an-older-checkpoint", [*TRAIN, "--output_dir", "{S}", "--resume_from_checkpoint",
                                             "{S}/checkpoint-2", *SHORT[2:], "--max_steps", "8"],
        ["checkpoint-4", "would overwrite it"], ["--resume_from_checkpoint auto"]),
    sub("train-resume-auto-into-the-export", [*TRAIN, "--output_dir", "{S}/export", "--resume_from_checkpoint",
                                              "auto", *SHORT], ["holds files but no hf_zero3 run"],
        ["--overwrite_output_dir true"]),
    sub("train-resume-a-missing-folder", [*TRAIN, "--output_dir", "{N}", "--resume_from_checkpoint",
                                          "{I}/no_such_checkpoint", *SHORT], ["no_such_checkpoint", "not a directory"],
        ["pass a checkpoint-N folder"]),
    sub("train-resume-the-export", [*TRAIN, "--output_dir", "{N}", "--resume_from_checkpoint", "{S}/export", *SHORT],
        ["{S}/export cannot be resumed"], ["--resume_from_checkpoint auto"]),
    sub("train-output-dir-a-file", [*TRAIN, "--output_dir", "{S}/config.json", *SHORT],
        ["config.json is a file, not a folder"], ["choose another output_dir"]),
    sub("train-yaml-syntax-error", ["hf-zero3", "train", "{I}/syntax_error.yaml", "--output_dir", "{N}"],
        ["syntax_error.yaml:2:12", "invalid YAML"], ["Fix the YAML there"]),
    sub("train-peft-override-cut-off", [*TRAIN, "--output_dir", "{N}", *SHORT, "--peft", "{r: 8, alpha: 16"],
        ["--peft:1:", "invalid YAML"], ["every { and [ closed"]),
    sub("train-checkpointing-kwargs-cut-off", [*TRAIN, "--output_dir", "{N}", *SHORT,
                                               "--gradient_checkpointing_kwargs", "{use_reentrant: false"],
        ["--gradient_checkpointing_kwargs:1:", "invalid YAML"], ["every { and [ closed"]),
    sub("train-more-experts-per-token-than-experts", [*TRAIN, "--output_dir", "{N}", *SHORT, "--model_name_or_path",
                                                      "null", "--config_name", "assets/tiny/mixtral",
                                                      "--config_overrides", "num_experts_per_tok=6"],
        ["num_experts_per_tok is 6", "num_local_experts 4"], ["at most 4"]),
    sub("train-yaml-unreadable", ["hf-zero3", "train", "{I}/unreadable.yaml", "--output_dir", "{N}"],
        ["unreadable.yaml", "cannot be read"], ["permissions"]),
    sub("train-yaml-a-list", ["hf-zero3", "train", "{I}/list.yaml", "--output_dir", "{N}"],
        ["list.yaml must be a YAML mapping"], ["argument: value"]),
    sub("train-misspelt-argument", [*TRAIN, "--output_dir", "{N}", *SHORT, "--learning_rat", "1e-4"],
        ["learning_rat"], ["did you mean learning_rate?"]),
    sub("train-max-steps-a-word", [*TRAIN, "--output_dir", "{N}", *SHORT[2:], "--max_steps", "ten"],
        ["'ten'"], ["max_steps takes a number"]),
    sub("train-fp16-on-cpu", ["python", "train.py", str(TINY_YAML), "--output_dir", "{N}", *SHORT, "--fp16", "true"],
        ["fp16 is not supported on CPU"], ["drop --fp16", "--bf16 true"]),
    sub("train-missing-train-file", [*TRAIN, "--output_dir", "{N}", *SHORT, "--train_file", "{I}/no_such_train.txt"],
        ["no_such_train.txt", "does not exist"], ["fix the path"]),
    sub("train-train-file-unreadable", [*TRAIN, "--output_dir", "{N}", *SHORT, "--train_file", "{I}/unreadable.txt"],
        ["unreadable.txt", "cannot be read"], ["permissions"]),
    sub("train-model-folder-without-config", [*TRAIN, "--output_dir", "{N}", *SHORT, "--model_name_or_path",
                                              "{S}/checkpoint-4/global_step4"], ["has no config.json"],
        ["point it at the folder save_pretrained wrote"]),
    sub("train-offline-dataset", [*TRAIN, "--output_dir", "{N}", *SHORT, "--train_file", "null",
                                  "--dataset_name", "someorg/no-such-dataset"],
        ["someorg/no-such-dataset", "could not be loaded"], ["train_file"],
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}),
    sub("train-ds-config-stage-4", ["python", "-m", "hf_zero3.train", str(TINY_YAML), "--output_dir", "{N}", *SHORT,
                                    "--deepspeed", "{I}/ds_stage4.json"], ["zero_optimization.stage", "got 4"],
        ["0, 1, 2 or 3"]),
    sub("train-ds-config-misspelt-block", [*TRAIN, "--output_dir", "{N}", *SHORT, "--deepspeed", "{I}/ds_typo.json"],
        ["zero_optimisation"], ["did you mean 'zero_optimization'"]),
    sub("train-ds-config-nvme-path-missing", [*TRAIN, "--output_dir", "{N}", *SHORT, "--deepspeed",
                                              "{I}/ds_nvme.json"], ["no_such_nvme", "does not exist"], ["mkdir -p"],
        absent=("{I}/no_such_nvme",)),
    sub("train-micro-batch-0", [*TRAIN, "--output_dir", "{N}", *SHORT, "--per_device_train_batch_size", "0"],
        ["per_device_train_batch_size", "0"], [">= 1"]),
    sub("train-block-size-above-model", [*TRAIN, "--output_dir", "{N}", *SHORT, "--block_size", "1024"],
        ["block_size=1024 exceeds the model's max positions (512)"], ["lower block_size to <= 512"]),
]

# --- recipes/tiny/launch.sh: the launch settings (stderr, exit 2), dry runs, and real 2-rank launches ---------------
LAUNCH_ROWS = [
    sub("launch-num-gpus-0", [*LAUNCH, "--output_dir", "{N}"], ["NUM_GPUS=0"], ["fix or unset it"],
        env={"NUM_GPUS": "0"}),
    sub("launch-num-gpus-a-word", [*LAUNCH, "--output_dir", "{N}"], ["NUM_GPUS=two"], ["fix or unset it"],
        env={"NUM_GPUS": "two"}),
    sub("launch-num-nodes-0", [*LAUNCH, "--output_dir", "{N}"], ["NUM_NODES=0"], ["fix or unset it"],
        env={"NUM_NODES": "0"}),
    sub("launch-two-nodes-without-hosts", [*LAUNCH, "--output_dir", "{N}"], ["NUM_NODES=2 needs the hosts"],
        ["set HOSTFILE", "HOSTS="], env={"NUM_NODES": "2"}),
    sub("launch-hostfile-missing", [*LAUNCH, "--output_dir", "{N}"], ["no_such_hostfile does not exist"],
        ["HOSTS="], env={"HOSTFILE": "{I}/no_such_hostfile"}),
    sub("launch-hostfile-a-folder", [*LAUNCH, "--output_dir", "{N}"], ["{S}", "Is a directory"],
        ["pass a readable DeepSpeed hostfile"], env={"HOSTFILE": "{S}"}),
    sub("launch-hostfile-unreadable", [*LAUNCH, "--output_dir", "{N}"], ["unreadable_hostfile", "cannot read"],
        ["pass a readable DeepSpeed hostfile"], env={"HOSTFILE": "{I}/unreadable_hostfile"}),
    sub("launch-hostfile-spaces", [*LAUNCH, "--output_dir", "{N}"], ["'localhost slots = 2'"],
        ["write `localhost slots=2`"], env={"HOSTFILE": "{I}/hostfile_spaces"}),
    sub("launch-too-few-slots", [*LAUNCH, "--output_dir", "{N}"], ["gives localhost 1 slot(s)"],
        ["set NUM_GPUS=1"], env={"HOSTFILE": "{I}/hostfile_one_slot", "NUM_GPUS": "2"}),
    sub("launch-more-nodes-than-hosts", [*LAUNCH, "--output_dir", "{N}"], ["lists 1 host(s)"],
        ["set NUM_NODES=1"], env={"HOSTFILE": "{I}/hostfile_one_slot", "NUM_NODES": "2", "NUM_GPUS": "1"}),
    sub("launch-hosts-twice", [*LAUNCH, "--output_dir", "{N}"], ["names a host twice"], ["list each host once"],
        env={"HOSTS": "node1,node1", "DRY_RUN": "1"}),
    sub("launch-dry-run-maybe", [*LAUNCH, "--output_dir", "{N}"], ["DRY_RUN=maybe"], ["set DRY_RUN=1"],
        env={"DRY_RUN": "maybe"}),
    sub("launch-master-port-70000", [*LAUNCH, "--output_dir", "{N}"], ["MASTER_PORT=70000"], ["fix or unset it"],
        env={"MASTER_PORT": "70000"}),
    sub("launch-ssh-port-a-word", [*LAUNCH, "--output_dir", "{N}"], ["SSH_PORT=abc"], ["fix or unset it"],
        env={"SSH_PORT": "abc"}),
    sub("launch-launcher-unknown", [*LAUNCH, "--output_dir", "{N}"], ["LAUNCHER=mpich is not supported"],
        ["use pdsh, openmpi"], env={"LAUNCHER": "mpich"}),
    sub("launch-launcher-slurm", [*LAUNCH, "--output_dir", "{N}"], ["LAUNCHER=slurm starts one srun task per rank"],
        ["scripts/slurm/train.sbatch"], env={"LAUNCHER": "slurm"}),
    sub("launch-hosts-a-slurm-node-list", [*LAUNCH, "--output_dir", "{N}"], ["is a SLURM node list"],
        ["scontrol show hostnames"], env={"HOSTS": "gpu-[01-03,07]", "DRY_RUN": "1"}),
    sub("launch-no-ssh-alone", [*LAUNCH, "--output_dir", "{N}"], ["NO_SSH=1 needs NODE_RANK", "needs MASTER_ADDR"],
        ["this node's index"], env={"NO_SSH": "1"}),
    sub("launch-node-rank-without-no-ssh", [*LAUNCH, "--output_dir", "{N}"], ["NODE_RANK is only used with NO_SSH=1"],
        ["set NO_SSH=1", "unset it"], env={"NODE_RANK": "1"}),
    sub("launch-include-and-exclude", [*LAUNCH, "--output_dir", "{N}"], ["INCLUDE and EXCLUDE are both set"],
        ["keep one"], env={"INCLUDE": "localhost:0", "EXCLUDE": "localhost:1"}),
    sub("launch-include-with-num-gpus", [*LAUNCH, "--output_dir", "{N}"], ["INCLUDE/EXCLUDE pick hosts"],
        ["unset NUM_GPUS"], env={"INCLUDE": "localhost:0", "NUM_GPUS": "1"}),
    sub("launch-include-unknown-host", [*LAUNCH, "--output_dir", "{N}"], ["INCLUDE", "'nohost' not found"],
        ["fix it against"], env={"INCLUDE": "nohost:0"}),
    sub("launch-gpu-mem-garbage", [*LAUNCH, "--output_dir", "{N}"], ["GPU_MEM=lots"], ["with a unit"],
        env={"DRY_RUN": "1", "GPU_MEM": "lots"}),
    sub("launch-host-ram-garbage", [*LAUNCH, "--output_dir", "{N}"], ["HOST_RAM=abc"], ["with a unit"],
        env={"DRY_RUN": "1", "GPU_MEM": "80GB", "HOST_RAM": "abc"}),
    sub("launch-recipe-missing", ["python", "-m", "hf_zero3", "launch", "{I}/no_such_recipe"],
        ["has no train_args.yaml"], ["pass a recipe folder"]),
    sub("launch-dry-run-misspelt-override", [*LAUNCH, "--output_dir", "{N}", "--learning_rat", "1"],
        ["learning_rat"], ["did you mean learning_rate?"], env={"DRY_RUN": "1"}),
    sub("launch-dry-run-bad-ds-config", [*LAUNCH, "--output_dir", "{N}", "--deepspeed", "{I}/ds_stage4.json"],
        ["zero_optimization.stage", "got 4"], ["0, 1, 2 or 3"], rc=1, stream="out", env={"DRY_RUN": "1"}),
    sub("launch-train-into-the-sentinel", [*LAUNCH, "--output_dir", "{S}", *SHORT], ["{S} already holds a run"],
        ["--resume_from_checkpoint auto"]),
    sub("launch-missing-train-file", [*LAUNCH, "--output_dir", "{N}", *SHORT, "--train_file",
                                      "{I}/no_such_train.txt"], ["no_such_train.txt", "does not exist"],
        ["fix the path"]),
    sub("launch-resume-on-another-world-size", [*LAUNCH, "--output_dir", "{N}", "--resume_from_checkpoint",
                                                "{S}/checkpoint-4", *SHORT[2:], "--max_steps", "8"],
        ["written by 1 ranks and this run has 2"], ["hf-zero3 reshard", '"load_universal": true']),
]

# --- the console script itself, for a few in-process rows' verbs ----------------------------------------------------
CONSOLE = [
    sub("console-config-check-trailing-comma", "hf-zero3 config check {I}/trailing_comma.json",
        ["not valid JSON"], ["line 1, column 35"], rc=1, stream="out"),
    sub("console-plan-gpu-mem-no-unit", "hf-zero3 plan --model tiny --gpus 1 --gpu-mem 40", ["--gpu-mem", "'40'"],
        ["with a unit"]),
    sub("console-export-into-the-export", "hf-zero3 export {S}/checkpoint-4 {S}/export",
        ["already exists and is not empty"], ["choose a new output folder"]),
    sub("console-doctor-hostfile-spaces", "hf-zero3 doctor --hostfile {I}/hostfile_spaces",
        ["'localhost slots = 2'"], ["write `localhost slots=2`"]),
    sub("console-module-config-new-stage-5", "python -m hf_zero3 config new --stage 5", ["--stage", "5"],
        ["choose from 0, 1, 2, 3"]),
]

IN_PROCESS = [r for r in CONFIG_CHECK + CONFIG_NEW + PLAN + DOCTOR + EXPORT + PUSH if not r.proc]
SUBPROCESS = [r for r in PUSH + TRAIN_ROWS + LAUNCH_ROWS + CONSOLE if r.proc]
ROWS = IN_PROCESS + SUBPROCESS


def verb(row: Row) -> str:
    """The verb or entry a row exercises: `config check`, `plan`, ..., `train`, `launch.sh`."""
    argv = list(row.argv)
    if argv[0] == "recipes/tiny/launch.sh":
        return "launch.sh"
    if argv[0] == "python":
        if argv[1] == "train.py" or argv[1:3] == ["-m", "hf_zero3.train"]:
            return "train"
        argv = argv[3:]  # python -m hf_zero3 VERB
    elif argv[0] == "hf-zero3":
        argv = argv[1:]
    return " ".join(argv[:2]) if argv[0] == "config" else argv[0]


def test_the_table_covers_every_verb_and_entry_point():
    assert len({r.id for r in ROWS}) == len(ROWS), "row ids must be unique"
    assert len(ROWS) >= 80
    assert {verb(r) for r in ROWS} == {"config check", "config new", "plan", "doctor", "export", "reshard", "push",
                                       "train", "launch", "launch.sh"}
    entries = {" ".join(r.argv[:3] if r.argv[1] == "-m" else r.argv[:2]) if r.argv[0] == "python" else r.argv[0]
               for r in SUBPROCESS}
    assert entries == {"hf-zero3", "recipes/tiny/launch.sh", "python train.py", "python -m hf_zero3.train",
                       "python -m hf_zero3"}
    for row in ROWS:
        assert row.problem and row.fix, row.id


# --- fixtures: the sentinel run, the bad input files -----------------------------------------------------------------

def digest(root: Path) -> dict[str, str]:
    """Every file (size and crc32 of its bytes: 4x cheaper than sha256, and taken after every row) and folder
    under root, by relative path."""
    found = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[name] = "link " + os.readlink(path)
        elif path.is_dir():
            found[name + "/"] = "folder"
        else:
            data = path.read_bytes()
            found[name] = f"{len(data)} bytes, crc32 {zlib.crc32(data):08x}"
    return found


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return ([f"added {k}" for k in sorted(after.keys() - before.keys())]
            + [f"removed {k}" for k in sorted(before.keys() - after.keys())]
            + [f"changed {k}" for k in sorted(before.keys() & after.keys()) if before[k] != after[k]])


class Sentinel:
    """A finished tiny run (checkpoint-2, checkpoint-4, the final model) with `export/` inside, its digest, and a
    pristine copy to restore it from after a row that changed it."""

    def __init__(self, root: Path):
        self.root, self.pristine = root / "sentinel", root / "pristine"
        proc = run([*TRAIN, "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "5", "--output_dir",
                    self.root, "--validation_file", "null", "--logging_steps", "1"], timeout=900)
        assert proc.returncode == 0, explain(proc)
        assert cli_main(["export", str(self.root / "checkpoint-4"), str(self.root / "export")]) == 0
        from hf_zero3.checkpoint.lifecycle import is_complete

        assert all(is_complete(self.root / f"checkpoint-{n}") for n in (2, 4))
        assert (self.root / "export" / "model.safetensors").is_file()
        shutil.copytree(self.root, self.pristine, symlinks=True)
        self.digest = digest(self.root)
        self.lock = threading.Lock()

    def changed(self) -> list[str]:
        """What differs from the digest taken after the run; the sentinel is restored if anything does."""
        with self.lock:
            found = changes(self.digest, digest(self.root))
            if found:
                shutil.rmtree(self.root, ignore_errors=True)
                shutil.copytree(self.pristine, self.root, symlinks=True)
            return found


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory) -> Sentinel:
    return Sentinel(tmp_path_factory.mktemp("bad_inputs"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """{I}: the bad files the rows point at. Returns {"dir": Path, "unreadable": bool}."""
    folder = tmp_path_factory.mktemp("inputs")
    tiny = json.loads((ROOT / "recipes/tiny/ds_config.json").read_text())
    nvme = str(folder / "no_such_nvme")
    files = {
        "trailing_comma.json": '{"zero_optimization": {"stage": 3,}}',
        "empty.json": "",
        "list.json": "[1, 2]",
        "typo_top.json": {"zero_optimisation": {"stage": 3}},
        "typo_zero.json": {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 10}},
        "stage4.json": {"zero_optimization": {"stage": 4}},
        "zero_string.json": {"zero_optimization": "three"},
        "tbs0.json": {"train_batch_size": 0},
        "micro_negative.json": {"train_micro_batch_size_per_gpu": -1},
        "fp16_bf16.json": {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "bfloat16_bf16.json": {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
        "auto.json": {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}},
        "nvme_missing.json": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                                  "nvme_path": nvme}}},
        "nvme_no_path.json": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        "offload_stage2.json": {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "offload_no_optimizer.json": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
        "batch16.json": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                         "gradient_accumulation_steps": 1},
        "fp16.json": {"fp16": {"enabled": True}},
        "clip_negative.json": {"gradient_clipping": -1},
        "ds_stage4.json": {**tiny, "zero_optimization": {**tiny["zero_optimization"], "stage": 4}},
        "ds_typo.json": {("zero_optimisation" if k == "zero_optimization" else k): v for k, v in tiny.items()},
        "ds_nvme.json": {**tiny, "zero_optimization": {**tiny["zero_optimization"], "offload_param": {
            "device": "nvme", "nvme_path": nvme}}},
        "syntax_error.yaml": "learning_rate: 1.0e-3\n  max_steps: [4\n",
        "list.yaml": "- learning_rate\n- max_steps\n",
        "hostfile_spaces": "localhost slots = 2\n",
        "hostfile_duplicate": "localhost slots=2\nlocalhost slots=2\n",
        "hostfile_comments": "# the nodes go here\n",
        "hostfile_slots_word": "localhost slots=two\n",
        "hostfile_one_slot": "localhost slots=1\n",
    }
    for name, content in files.items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    (folder / "binary.json").write_bytes(bytes(range(128, 256)) * 4)
    model = ROOT / "assets/tiny/model"
    (folder / "no_weights").mkdir()
    shutil.copy(model / "config.json", folder / "no_weights" / "config.json")
    (folder / "truncated").mkdir()
    shutil.copy(model / "config.json", folder / "truncated" / "config.json")
    (folder / "truncated" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    unreadable = True
    (folder / "unreadable_weights").mkdir()
    shutil.copy(model / "config.json", folder / "unreadable_weights" / "config.json")
    for name in ("unreadable.json", "unreadable.yaml", "unreadable.txt", "unreadable_hostfile",
                 "unreadable_model/config.json", "unreadable_weights/model.safetensors"):
        try:
            make_unreadable(folder / name)
        except pytest.skip.Exception:
            unreadable = False
    return {"dir": folder, "unreadable": unreadable}


def closed_port() -> int:
    return free_port()  # nothing listens on it once free_port's socket is closed


def fill(row: Row, sentinel: Sentinel, inputs: dict, fresh: Path, port: int):
    """The row's argv, env and absent paths with the placeholders filled in."""
    def sub_(text: str) -> str:
        return (text.replace("{S}", str(sentinel.root)).replace("{I}", str(inputs["dir"]))
                .replace("{N}", str(fresh / "out")).replace("{PORT}", str(port)))

    return ([sub_(a) for a in row.argv], {k: None if v is None else sub_(v) for k, v in row.env.items()},
            [Path(sub_(p)) for p in row.absent], sub_)


def verdict(row: Row, rc, out: str, err: str, sentinel_changes: list[str], fresh: Path, absent: list[Path],
            sub_, note: str = "") -> None:
    """Every assertion of a row, reported together with the output."""
    failures = []
    if rc != row.rc:
        failures.append(f"exit status {rc}, expected {row.rc}")
    for name, text in (("stdout", out), ("stderr", err)):
        if "Traceback" in text:
            failures.append(f"a traceback on {name}")
    stream = out if row.stream == "out" else err
    for kind, words in (("problem", row.problem), ("fix", row.fix)):
        missing = [sub_(w) for w in words if sub_(w).lower() not in stream.lower()]
        if missing:
            failures.append(f"std{row.stream} does not name the {kind}: missing {missing}")
    if sentinel_changes:
        failures.append(f"the sentinel changed{note}: {sentinel_changes[:10]}")
    if fresh.exists() and any(fresh.iterdir()):
        failures.append(f"wrote into a fresh path: {sorted(p.name for p in fresh.iterdir())}")
    for path in absent:
        if path.exists() or path.is_symlink():
            failures.append(f"created {path}")
    assert not failures, (f"{row.id}: " + "; ".join(failures) + f"\n--- exit {rc}\n--- stdout (tail)\n{out[-3000:]}"
                          f"\n--- stderr (tail)\n{err[-3000:]}")


def uses_unreadable(row: Row) -> bool:
    return any("unreadable" in str(a) for a in (*row.argv, *row.env.values()))


def needs_unreadable(row: Row, inputs: dict) -> None:
    if uses_unreadable(row) and not inputs["unreadable"]:
        pytest.skip("no unreadable file can be made on this machine")


def test_the_sentinel_check_sees_one_flipped_byte_and_restores_it(sentinel):
    """The control: a same-size, same-mtime change of one byte is caught, and the sentinel is put back."""
    target = sentinel.root / "checkpoint-2" / "model.safetensors"
    stat = target.stat()
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert sentinel.changed() == ["changed checkpoint-2/model.safetensors"]
    assert digest(sentinel.root) == sentinel.digest and sentinel.changed() == []


# --- in-process rows -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("row", IN_PROCESS, ids=[r.id for r in IN_PROCESS])
def test_in_process(row, sentinel, inputs, tmp_path, capfd, monkeypatch):
    needs_unreadable(row, inputs)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    argv, env, absent, sub_ = fill(row, sentinel, inputs, fresh, closed_port())
    monkeypatch.chdir(ROOT)
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    capfd.readouterr()
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    except Exception:  # noqa: BLE001 -- an uncaught error is what the row reports
        rc = "an exception"
        traceback.print_exc()
    out, err = capfd.readouterr()
    verdict(row, rc, out, err, sentinel.changed(), fresh, absent, sub_)


# --- subprocess rows, a few at a time ---------------------------------------------------------------------------------

class Pool:
    """Runs every subprocess row on a small thread pool; each row's result carries the sentinel's changes seen
    right after it ended, and the rows that were running meanwhile."""

    def __init__(self, sentinel: Sentinel, inputs: dict, root: Path, rows: list[Row]):
        self.sentinel, self.inputs, self.root = sentinel, inputs, root
        self.running: set[str] = set()
        self.lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=WORKERS)
        self.futures = {row.id: self.executor.submit(self._run, row) for row in sorted(rows, key=self.cost)}

    @staticmethod
    def cost(row: Row) -> int:
        """Slowest first: real 2-rank launches, then train processes, dry runs, then launch settings (< 1 s)."""
        if row.argv[0] == LAUNCH[0]:
            return 0 if not row.env else 2 if row.env.get("DRY_RUN") == "1" else 3
        return 1

    def _run(self, row: Row):
        if uses_unreadable(row) and not self.inputs["unreadable"]:
            return None
        fresh = self.root / row.id
        fresh.mkdir()
        argv, env, absent, sub_ = fill(row, self.sentinel, self.inputs, fresh, closed_port())
        program = sys.executable if argv[0] == "python" else str(ROOT / argv[0]) if "/" in argv[0] else argv[0]
        full_env = subprocess_env(**{k: v for k, v in env.items() if v is not None})
        for key in [k for k, v in env.items() if v is None]:
            full_env.pop(key, None)
        with self.lock:
            self.running.add(row.id)
        try:
            proc = subprocess.run([program, *argv[1:]], check=False, cwd=ROOT, env=full_env, capture_output=True,
                                  text=True, timeout=600)
        finally:
            with self.lock:
                beside = sorted(self.running - {row.id})
        changed = self.sentinel.changed()
        with self.lock:
            self.running.discard(row.id)
        return proc, changed, beside, fresh, absent, sub_

    def result(self, row: Row):
        return self.futures[row.id].result()


@pytest.fixture(scope="module")
def pool(sentinel, inputs, tmp_path_factory, request):
    selected = [item.callspec.params["row"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_subprocess"]  # -k runs only those
    pool = Pool(sentinel, inputs, tmp_path_factory.mktemp("fresh"), selected)
    yield pool
    pool.executor.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("row", SUBPROCESS, ids=[r.id for r in SUBPROCESS])
def test_subprocess(row, pool, inputs):
    needs_unreadable(row, inputs)
    proc, changed, beside, fresh, absent, sub_ = pool.result(row)
    note = f" (rows running beside it: {', '.join(beside)})" if changed and beside else ""
    verdict(row, proc.returncode, proc.stdout, proc.stderr, changed, fresh, absent, sub_, note)
