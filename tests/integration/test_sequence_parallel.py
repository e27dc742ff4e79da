"""Ulysses sequence parallelism changes where a sequence lives, not what is learned: on 2 CPU ranks (gloo runs the
all-to-all), `sequence_parallel_size 2` trains the same losses and gradients as one rank without it (fp32), on raw
text and on packed chat data, and resumes exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, losses_by_step, run, train_log, weights

pytestmark = pytest.mark.integration

STEPS = 6
COMMON = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_steps", "100", "--validation_file", "null",
          "--learning_rate", "1.0e-3", "--warmup_steps", "2", "--attn_implementation", "sdpa"]
CHAT = ["--train_file", ROOT / "assets/tiny/chat/train.jsonl", "--block_size", "256"]
LORA = ["--peft", json.dumps({"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"})]
EXTRA = {"text": [], "packed_chat": CHAT, "lora": LORA}
TILED = ["--tiled_compute", "true", "--tiled_compute_tokens", "48"]
"""The packed chat run also tiles (each rank's 128 tokens: 3 MLP and loss tiles, the last one short): tiling on
(here) and off (the plain run) give the same losses and gradients under ZeRO-3 and sequence parallelism too."""


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    """The same starting weights for every run, loaded with from_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sp") / "init"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model")).save_pretrained(folder)
    return folder


def _records(out) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in train_log(out) if "loss" in r]


def _sp_run(init, out, *extra):
    return run([ROOT / "recipes/tiny/launch.sh", "--model_name_or_path", init, "--per_device_train_batch_size", "4",
                "--sequence_parallel_size", "2", "--output_dir", out, *COMMON, *extra], MASTER_PORT=str(free_port()))


def _plain_run(init, out, *extra):
    return run(["python", "-m", "hf_zero3.train", TINY_YAML, "--deepspeed", "null", "--model_name_or_path", init,
                "--per_device_train_batch_size", "4", "--output_dir", out, *COMMON, *extra])


def _same(ours, reference, tolerance=1e-5):
    assert len(ours) == len(reference) == STEPS, (ours, reference)
    print("max loss / grad-norm difference:", max(abs(a[0] - b[0]) for a, b in zip(ours, reference)),
          max(abs(a[1] - b[1]) for a, b in zip(ours, reference)))
    for (loss, norm), (ref_loss, ref_norm) in zip(ours, reference):
        assert abs(loss - ref_loss) < tolerance and abs(norm - ref_norm) < tolerance * max(1.0, ref_norm), \
            list(zip(ours, reference))


@pytest.fixture(scope="module")
def sp_runs(init, tmp_path_factory):
    """Per data kind, the 2-rank sequence-parallel run (a checkpoint at step 3) and the 1-rank plain run."""
    done = {}

    def get(data):
        if data not in done:
            root, extra = tmp_path_factory.mktemp(data), EXTRA[data]
            sp = _sp_run(init, root / "sp", "--save_steps", "3", *extra, *(TILED if data == "packed_chat" else []))
            assert sp.returncode == 0, explain(sp)
            plain = _plain_run(init, root / "plain", *extra)
            assert plain.returncode == 0, explain(plain)
            done[data] = root, sp
        return done[data]
    return get


def _final(out) -> dict[str, torch.Tensor]:
    """The final model's weights, or a LoRA run's adapter."""
    from safetensors.torch import load_file

    return load_file(out / "adapter_model.safetensors") if (out / "adapter_model.safetensors").is_file() \
        else weights(out)


@pytest.mark.parametrize("data", ["text", "packed_chat", "lora"])
def test_two_way_sequence_parallel_matches_one_rank(sp_runs, data):
    root, sp = sp_runs(data)
    assert "x 1 data-parallel ranks (2 ranks / sequence parallel 2) = global batch 4" in sp.stdout, sp.stdout
    assert "sequence parallel 2 (Ulysses, sdpa)" in sp.stdout
    assert ("tiled compute on: 4 MLPs" in sp.stdout) == (data == "packed_chat")
    reference = _records(root / "plain")
    assert reference[-1][0] < reference[0][0]
    _same(_records(root / "sp"), reference)
    ours, expected = _final(root / "sp"), _final(root / "plain")
    assert ours.keys() == expected.keys() and max((ours[k] - expected[k]).abs().max().item() for k in expected) < 1e-5


def test_sequence_parallel_resumes_exactly(init, sp_runs, tmp_path):
    root, _ = sp_runs("text")
    resumed = tmp_path / "resumed"
    shutil.copytree(root / "sp" / "checkpoint-3", resumed / "checkpoint-3")
    again = _sp_run(init, resumed, "--resume_from_checkpoint", "auto")
    assert again.returncode == 0, explain(again)
    assert losses_by_step(resumed) == {s: v for s, v in losses_by_step(root / "sp").items() if s > 3}
    ours, expected = weights(resumed), weights(root / "sp")
    assert all(torch.equal(ours[k], expected[k]) for k in expected)
