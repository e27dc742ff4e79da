"""Mixtures of experts under real 2-rank ZeRO-3 on CPU: two families (Mixtral's shape and Qwen3-MoE's, tiny, from
assets/tiny), weights saved by `save_pretrained` (per expert) and fused again by `from_pretrained` under ZeRO-3's
partitioning. Each run has a timeout that fails the test: with top-k routing a missing leaf module hangs the ranks.
The same losses as one plain process; checkpoints that verify, resume and export to what `save_pretrained` writes."""

from __future__ import annotations

import shutil

import pytest
import torch

from hf_zero3.checkpoint import contents
from hf_zero3.checkpoint.export import export_checkpoint
from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, losses, losses_by_step, run

pytestmark = pytest.mark.integration

COMMON = ["--max_steps", "6", "--logging_steps", "1", "--save_steps", "3", "--validation_file", "null",
          "--learning_rate", "1.0e-3", "--warmup_steps", "2", "--tokenizer_name", ROOT / "assets/tiny/model"]
HANG_S = 240
"""A 2-rank tiny MoE run takes ~20 s on 2 cores; a hang shows as this timeout."""
FAMILIES = {"mixtral": "MixtralSparseMoeBlock", "qwen3-moe": "Qwen3MoeSparseMoeBlock"}


def zero3(out, init, *extra):
    return run([ROOT / "recipes/tiny/launch.sh", "--model_name_or_path", init, "--per_device_train_batch_size", "4",
                "--output_dir", out, *COMMON, *extra], timeout=HANG_S, MASTER_PORT=str(free_port()))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request, tmp_path_factory):
    """(family, root, init weights): the family trained 6 steps with ZeRO-3 on 2 ranks, saving at 3 and 6."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, root = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny" / family)).save_pretrained(
        root / "init")
    proc = zero3(root / "zero3", root / "init")
    assert proc.returncode == 0, explain(proc)
    assert f"ZeRO-3 leaf modules (found from the model's experts; each gathered whole when entered): " \
           f"{FAMILIES[family]} x2" in proc.stdout, explain(proc)
    return family, root


def test_two_rank_zero3_trains_like_one_plain_process(trained):
    family, root = trained
    plain = run(["python", "-m", "hf_zero3.train", TINY_YAML, "--deepspeed", "null", "--model_name_or_path",
                 root / "init", "--per_device_train_batch_size", "8", "--output_dir", root / "plain", *COMMON],
                timeout=HANG_S)
    assert plain.returncode == 0, explain(plain)
    assert "leaf modules" not in plain.stdout  # without ZeRO-3 there is nothing to gather
    ours, reference = losses(root / "zero3"), losses(root / "plain")
    assert len(ours) == len(reference) == 6 and reference[-1] < reference[0]
    assert max(abs(a - b) for a, b in zip(ours, reference)) < 1e-4, list(zip(ours, reference))


def test_its_checkpoints_verify_and_export_to_the_layout_save_pretrained_writes(trained, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    family, root = trained
    for step in (3, 6):
        assert contents.verify_checkpoint(root / "zero3" / f"checkpoint-{step}") == []
    exported = export_checkpoint(root / "zero3/checkpoint-6", tmp_path / "hf", dtype="fp32")
    with safe_open(exported / "model.safetensors", "pt") as f, \
            safe_open(root / "zero3/model.safetensors", "pt") as g:  # the Trainer's final save_pretrained
        assert sorted(f.keys()) == sorted(g.keys())
        assert any(".experts.0." in key for key in f.keys())  # per expert, as the hub's checkpoints are
    final, back = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (root / "zero3", exported))
    for (name, a), b in zip(final.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("trained", ["mixtral"], indirect=True)  # one family: the checkpoint format is the same
def test_resuming_from_the_first_checkpoint_continues_the_same_losses(trained, tmp_path):
    family, root = trained
    shutil.copytree(root / "zero3/checkpoint-3", tmp_path / "out/checkpoint-3")
    proc = zero3(tmp_path / "out", root / "init", "--resume_from_checkpoint", "auto")
    assert proc.returncode == 0, explain(proc)
    resumed, reference = losses_by_step(tmp_path / "out"), losses_by_step(root / "zero3")
    assert sorted(resumed) == [4, 5, 6]
    assert all(abs(resumed[s] - reference[s]) < 1e-5 for s in resumed), (resumed, reference)
