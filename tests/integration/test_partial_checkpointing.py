"""`gradient_checkpointing_layers` under real 2-rank ZeRO-3 on CPU (the tiny recipe through `deepspeed`): the
callback reaches the model DeepSpeed wraps, and checkpointing fewer layers changes no number."""

from __future__ import annotations

import pytest

from hf_zero3.job.distributed import free_port
from tests.conftest import TINY_YAML, explain, run, train_log

pytestmark = pytest.mark.integration

STEPS = 6
COMMON = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "no", "--validation_file", "null",
          "--save_final_model", "false", "--gradient_checkpointing", "true",
          "--gradient_checkpointing_kwargs", '{"use_reentrant": false}']


def _train(tmp_path, name: str, *extra):
    out = tmp_path / name
    proc = run(["deepspeed", "--num_gpus", "2", "--master_port", free_port(), "--module", "hf_zero3.train",
                TINY_YAML, "--output_dir", out, *COMMON, *extra])
    assert proc.returncode == 0, explain(proc)
    steps = [r for r in train_log(out) if "loss" in r and "train_runtime" not in r]
    return proc.stdout + proc.stderr, [(r["loss"], r["grad_norm"]) for r in steps]


def test_two_of_four_layers_checkpointed_under_zero3_give_the_same_losses_and_gradients(tmp_path):
    _, full = _train(tmp_path, "all")
    output, partial = _train(tmp_path, "first2", "--gradient_checkpointing_layers", "2")
    assert "activation checkpointing on the first 2 layers; the last 2 keep their activations" in output
    assert len(full) == STEPS and partial == full  # fp32: recomputing fewer layers is bit for bit the same
