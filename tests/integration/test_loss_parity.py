"""ZeRO-3 changes where the numbers live, not what they are: 2 ranks with ZeRO-3 == 1 plain rank (fp32)."""

from __future__ import annotations

import pytest
import torch

from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, losses, run

pytestmark = pytest.mark.integration

COMMON = ["--max_steps", "20", "--logging_steps", "1", "--save_steps", "100", "--validation_file", "null",
          "--learning_rate", "1.0e-3", "--warmup_steps", "2"]


def test_two_rank_zero3_matches_one_rank_plain_trainer(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    init = tmp_path / "init"  # same starting weights for both runs, loaded with from_pretrained
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model")).save_pretrained(init)

    zero3 = run([ROOT / "recipes/tiny/launch.sh", "--model_name_or_path", init, "--per_device_train_batch_size", "4",
                 "--output_dir", tmp_path / "zero3", *COMMON], MASTER_PORT=str(free_port()))
    assert zero3.returncode == 0, explain(zero3)
    assert "ZeRO stage 3 | world size 2 | micro batch 4 x accumulation 1 x 2 ranks = global batch 8" in zero3.stdout

    plain = run(["python", "-m", "hf_zero3.train", TINY_YAML, "--deepspeed", "null", "--model_name_or_path", init,
                 "--per_device_train_batch_size", "8", "--output_dir", tmp_path / "plain", *COMMON])
    assert plain.returncode == 0, explain(plain)
    assert "ZeRO stage off (no deepspeed config) | world size 1 | micro batch 8" in plain.stdout

    ours, reference = losses(tmp_path / "zero3"), losses(tmp_path / "plain")
    assert len(ours) == len(reference) == 20
    assert reference[-1] < reference[0]
    assert max(abs(a - b) for a, b in zip(ours, reference)) < 1e-4, list(zip(ours, reference))
