"""A chat file (packed) and a mixture of chat, prompt/completion and raw text (padded), each trained end to end
under real 2-rank ZeRO-3 on CPU from the tiny recipe and the shipped chat files."""

from __future__ import annotations

import pytest
import torch
import yaml

from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, run, train_log

pytestmark = pytest.mark.integration

CHAT = ROOT / "assets/tiny/chat"
SHORT = ["--max_steps", "4", "--logging_steps", "2", "--save_steps", "4", "--eval_strategy", "steps",
         "--eval_steps", "4", "--block_size", "256"]


def train(out, *args, yaml_path=TINY_YAML):
    """`torchrun` with 2 ranks on the tiny recipe (ZeRO-3 from its ds_config), four steps."""
    proc = run(["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "-m", "hf_zero3.train",
                yaml_path, *SHORT, *args, "--output_dir", out])
    assert proc.returncode == 0, explain(proc)
    assert "ZeRO stage 3 | world size 2 |" in proc.stdout
    assert (out / "checkpoint-4" / "model.safetensors").is_file() and (out / "model.safetensors").is_file()
    return proc


def evals(out) -> dict:
    return [r for r in train_log(out) if "eval_loss" in r][-1]


def test_a_chat_file_trains_packed_with_loss_on_the_responses(tmp_path):
    out = tmp_path / "chat"
    proc = train(out, "--train_file", CHAT / "train.jsonl", "--validation_file", CHAT / "validation.jsonl")
    assert "hf_zero3: data: 3000 train examples" in proc.stdout and " packed train rows of 256 tokens" in proc.stdout
    record = evals(out)
    assert 0 < record["eval_mean_token_accuracy"] < 1 and torch.isfinite(torch.tensor(record["eval_loss"]))
    first = train_log(out)[0]  # TRL's SFTTrainer ran: its per-step extras are logged beside our own
    assert 0 <= first["mean_token_accuracy"] < 1 and first["entropy"] > 0 and first["step_time_s"] > 0
    assert "eval_perplexity" in record


def test_a_mixture_of_chat_prompt_completion_and_raw_text_trains_padded(tmp_path):
    """The prompt/completion file trains here, beside chat and raw text, one example per padded row."""
    recipe = yaml.safe_load(TINY_YAML.read_text())
    recipe.pop("train_file")
    recipe["deepspeed"] = str(ROOT / "recipes/tiny/ds_config.json")
    recipe["validation_split_percentage"] = 5
    recipe.pop("validation_file")
    recipe["datasets"] = [{"path": str(CHAT / "train.jsonl"), "examples": 600},
                          {"path": str(CHAT / "instructions.jsonl"), "examples": 300},
                          {"path": str(ROOT / "assets/tiny/corpus/validation.txt"), "examples": 100}]
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "mix"
    proc = train(out, "--packing", "false", yaml_path=path)
    # 5% of each source held out before the counts are drawn from the rest: no row is trained and evaluated both
    for line in ("train.jsonl: 600 examples (0.21 x its 2850)", "instructions.jsonl: 300 examples (0.16 x its 1900)",
                 "validation.txt: 100 examples", "1000 train examples:"):
        assert line in proc.stdout, proc.stdout
    assert 0 < evals(out)["eval_mean_token_accuracy"] < 1
