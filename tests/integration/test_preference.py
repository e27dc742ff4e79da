"""The preference stages under real 2-rank ZeRO-3 on CPU: our DPO run's first steps equal TRL's own DPOTrainer run
as TRL documents it, the precomputed reference gives the live reference's losses, and KTO and ORPO train."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, run, train_log

pytestmark = pytest.mark.integration

PAIRS = ROOT / "assets/tiny/preference/pairs.jsonl"
UNPAIRED = ROOT / "assets/tiny/preference/unpaired.jsonl"
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins")
SHORT = ["--max_steps", "3", "--logging_steps", "1", "--save_steps", "3", "--warmup_steps", "1",
         "--per_device_train_batch_size", "4", "--validation_file", "null"]


def torchrun(*args):
    return run(["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), *args])


def train(out, *args):
    proc = torchrun("-m", "hf_zero3.train", TINY_YAML, *SHORT, *args, "--output_dir", out)
    assert proc.returncode == 0, explain(proc)
    return proc


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The tiny model with random weights saved as a pretrained folder: TRL loads its policy and reference by path."""
    folder = tmp_path_factory.mktemp("tiny-weights")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model")).save_pretrained(folder)
    AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model").save_pretrained(folder)
    return folder


def steps(records) -> list[dict]:
    return [r for r in records if "rewards/margins" in r or "loss" in r and "train_loss" not in r]


def test_dpo_steps_equal_trls_dpo_trainer_and_a_precomputed_reference_gives_the_same_losses(tmp_path, weights):
    baseline = tmp_path / "trl"
    proc = torchrun(ROOT / "tests/integration/trl_dpo_baseline.py", weights, PAIRS, baseline)
    assert proc.returncode == 0, explain(proc)
    theirs = steps(json.loads((baseline / "log.json").read_text()))
    ours = train(tmp_path / "ours", "--stage", "dpo", "--model_name_or_path", weights, "--train_file", PAIRS)
    assert "reference: a second model" in ours.stdout
    mine = steps(train_log(tmp_path / "ours"))
    assert len(theirs) == len(mine) == 3
    for a, b in zip(mine, theirs):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, mine, theirs)
    assert mine[0]["loss"] == pytest.approx(0.6931, abs=1e-4) and mine[-1]["rewards/margins"] != 0
    marker = json.loads((tmp_path / "ours/checkpoint-3/hf_zero3_complete.json").read_text())
    assert marker["sources"]["stage"].startswith("stage dpo (TRL DPOTrainer) | loss sigmoid | beta 0.1 | reference")

    pre = train(tmp_path / "pre", "--stage", "dpo", "--model_name_or_path", weights, "--train_file", PAIRS,
                "--stage_args", '{"precompute_ref_log_probs": true}')
    assert "reference: log-probs precomputed" in pre.stdout
    for a, b in zip(steps(train_log(tmp_path / "pre")), mine):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    stored = list((tmp_path / "pre/reference_logps").glob("train/*/logps/*.arrow"))
    assert len(stored) == 1, stored  # keyed by data, tokenizer, chat template and reference weights
    key = json.loads((stored[0].parents[1] / "key.json").read_text())  # each part recorded, to name what differs
    assert key["key"] == stored[0].parents[1].name
    assert set(key["parts"]) == {"data", "tokenizer", "chat template", "reference weights"}
    assert "Computing reference log probs" in pre.stdout + pre.stderr
    written = stored[0].stat().st_mtime_ns
    resumed = train(tmp_path / "pre", "--stage", "dpo", "--model_name_or_path", weights, "--train_file", PAIRS,
                    "--stage_args", '{"precompute_ref_log_probs": true}', "--max_steps", "4",
                    "--resume_from_checkpoint", "auto")
    assert "Computing reference log probs" not in resumed.stdout + resumed.stderr  # read back, not computed again
    assert stored[0].stat().st_mtime_ns == written
    assert steps(train_log(tmp_path / "pre"))[-1]["step"] == 4  # resumed, the reference log-probs reused


@pytest.mark.parametrize(("stage", "data"), [("kto", UNPAIRED), ("orpo", PAIRS)])
def test_kto_and_orpo_train_and_their_loss_falls(tmp_path, stage, data):
    out = tmp_path / stage
    proc = train(out, "--stage", stage, "--train_file", data, "--max_steps", "8", "--save_steps", "8",
                 "--learning_rate", "3e-3")
    assert f"stage {stage} (TRL " in proc.stdout
    losses = [r["loss"] for r in steps(train_log(out))]
    assert len(losses) == 8 and losses[-1] < losses[0], losses


@pytest.mark.parametrize(("recipe", "stage", "checkpointing"), [("70b-dpo-lora", 3, True), ("8b-dpo", 2, False)])
def test_a_dpo_lora_recipe_trains_scoring_the_reference_with_the_adapter_off_and_saves_a_verified_adapter(
        tmp_path, weights, recipe, stage, checkpointing):
    """Each DPO recipe as shipped (launch.sh, ds_config.json, train_args.yaml: stage dpo, stage_args, its peft block,
    bf16, its checkpointing) on the tiny model: the LoRA path of DPO under ZeRO-3 and under ZeRO-2."""
    out = tmp_path / "lora"
    proc = run([ROOT / f"recipes/{recipe}/launch.sh", "--model_name_or_path", weights, "--train_file", PAIRS,
                "--block_size", "128", *SHORT, "--gradient_accumulation_steps", "1", "--learning_rate", "3.0e-3",
                "--output_dir", out], NUM_NODES="1", NUM_GPUS="2", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, explain(proc)
    assert f"train.py recipes/{recipe}/train_args.yaml --deepspeed recipes/{recipe}/ds_config.json" in proc.stdout
    assert f"hf_zero3: ZeRO stage {stage} | world size 2 |" in proc.stdout
    assert "reference: the base model with the LoRA adapter disabled" in proc.stdout
    logged = steps(train_log(out))
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # adapter B starts at zero: policy = reference
    assert logged[-1]["rewards/margins"] != 0 and (out / "adapter_model.safetensors").is_file()
    assert not (out / "ref").exists()  # TRL's frozen copy of the adapter (its reference for a trained one) is gone
    resolved = json.loads((out / "run_config.json").read_text())["training"]
    assert resolved["bf16"] and resolved["gradient_checkpointing"] == checkpointing  # the recipe's own settings ran


def test_the_reference_of_a_mixture_of_experts_gets_the_policys_leaf_modules(tmp_path):
    """Prepared as the policy is: without ZeRO-3 leaf modules an expert block's ranks fetch different experts."""
    out = tmp_path / "moe"
    proc = train(out, "--stage", "dpo", "--config_name", ROOT / "assets/tiny/mixtral", "--tokenizer_name",
                 ROOT / "assets/tiny/model", "--train_file", PAIRS)
    assert "hf_zero3: reference model: ZeRO-3 leaf modules" in proc.stdout and "MixtralSparseMoeBlock x2" in proc.stdout
    first = steps(train_log(out))[0]  # its loss adds the router's auxiliary loss to DPO's log 2
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0  # the same random start as the policy
