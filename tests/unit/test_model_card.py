"""The export's model card as the Hub reads it: ModelCard.load and its metadata parsing, the model-index results,
and none of what made the old card unfit (local paths, `Infinity`, "1 ranks", a TrainingArguments dump)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.checkpoint.card import model_card
from tests.conftest import make_checkpoint


def _marker(tmp_path, world_size=1, **sources):
    """A marker as CheckpointGuardCallback writes it, with real TrainingArguments (output_dir and logging_dir
    are local paths) and a ds_config holding `inf` and an NVMe path."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "secret-run-dir"), learning_rate=2e-5, bf16=False,
                             per_device_train_batch_size=4, gradient_accumulation_steps=8, max_steps=100,
                             warmup_steps=10, seed=7, use_cpu=True, report_to=[])
    return {"world_size": world_size, "hf_zero3_version": "0.1.0", "written_at": "2026-11-30T20:00:00+0000",
            "hardware": {"ranks": world_size, "device": "NVIDIA H200"}, "recipe": {"name": "8b", "version": "v2"},
            "versions": {"python": "3.11.9", "torch": "2.13.0", "deepspeed": "0.19.8", "transformers": "5.24.0"},
            "throughput": {"samples_per_second": 14.3, "steps_per_second": 0.9, "measured_over_steps": 10},
            "ds_config": {"steps_per_print": math.inf, "zero_optimization": {
                "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}}},
            "training_args": json.loads(args.to_json_string()), "sources": sources}


def _card(tmp_path, marker, history, **kwargs):
    folder = make_checkpoint(tmp_path / "out" / "my-run", 100, marked=False)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 100, "log_history": history}))
    ckpt.write_marker(folder, marker)
    path = tmp_path / "README.md"
    path.write_text(str(model_card(folder, dtype="bf16", **kwargs)))
    return path


HISTORY = [{"step": 50, "loss": 2.9}, {"step": 50, "eval_loss": 2.5}, {"step": 100, "loss": 2.25},
           {"step": 100, "eval_loss": 2.0, "eval_perplexity": math.exp(2.0)}]


def test_card_loads_with_hub_metadata_and_model_index_results(tmp_path):
    from huggingface_hub import ModelCard

    marker = _marker(tmp_path, world_size=1, base_model="meta-llama/Meta-Llama-3-8B", datasets=["wikitext"])
    path = _card(tmp_path, marker, HISTORY, license="llama3")
    card = ModelCard.load(path)  # parses the YAML and the model-index into EvalResults, raising if malformed
    data = card.data
    assert (data.base_model, data.datasets, data.license, data.library_name) == (
        "meta-llama/Meta-Llama-3-8B", ["wikitext"], "llama3", "transformers")
    assert {"hf_zero3", "deepspeed", "zero3", "recipe:8b"} <= set(data.tags)
    results = {r.metric_type: r for r in data.eval_results}
    assert results["loss"].metric_value == 2.0 and results["perplexity"].metric_value == round(math.exp(2.0), 4)
    assert results["loss"].dataset_type == "wikitext" and results["loss"].task_type == "text-generation"
    assert data.model_name == "my-run"
    header = path.read_text().split("---")[1]
    json.dumps(yaml.safe_load(header), allow_nan=False)  # the metadata is valid JSON: no Infinity, no NaN
    body = card.text
    for text in ("[meta-llama/Meta-Llama-3-8B](https://huggingface.co/meta-llama/Meta-Llama-3-8B)",
                 "on [wikitext](https://huggingface.co/datasets/wikitext)", "- Loss: 2.0000", "- Perplexity: 7.3891",
                 "- Recipe: `8b` v2", "- Final training loss: 2.2500 (step 100)", "- learning_rate: 2e-05",
                 "- train_batch_size: 4", "- gradient_accumulation_steps: 8", "- total_train_batch_size: 32",
                 "- num_devices: 1", "- training_steps: 100", "- lr_scheduler_warmup_steps: 10", "- seed: 7",
                 "- offload_optimizer: nvme", "- Hardware: 1 × NVIDIA H200",
                 "- Throughput: 14.30 samples/s, 0.900 steps/s", "over 10 steps",
                 "- hf_zero3 0.1.0", "- torch 2.13.0", "- deepspeed 0.19.8", "- transformers 5.24.0"):
        assert text in body, text


def test_card_has_no_local_path_no_infinity_no_one_ranks_and_no_arguments_dump(tmp_path):
    marker = _marker(tmp_path, world_size=1, base_model=str(tmp_path / "local-llama"), datasets=[])
    text = _card(tmp_path, marker, HISTORY).read_text()
    assert str(tmp_path) not in text and "secret-run-dir" not in text and "nvme_path" not in text
    assert "Infinity" not in text and "NaN" not in text
    assert "1 ranks" not in text and "ranks" not in text
    assert "logging_dir" not in text and "per_device_eval_batch_size" not in text  # a short list, not a dump
    assert len([line for line in text.splitlines() if line.startswith("- ")]) < 40
    assert "base_model" not in text.split("---")[1]  # a local folder is not a Hub id
    assert "fine-tuned from a local model" in text and "license: other" in text


@pytest.mark.parametrize("history", [[], [{"step": 10, "loss": 3.0}]])
def test_card_without_an_evaluation_has_no_model_index_and_still_loads(tmp_path, history):
    from huggingface_hub import ModelCard

    path = _card(tmp_path, _marker(tmp_path), history)
    card = ModelCard.load(path)
    assert card.data.eval_results is None and "model-index" not in path.read_text()
    assert "trained from scratch" in card.text


def test_the_card_of_a_finished_output_dir_comes_from_its_newest_checkpoint(tmp_path):
    """`hf-zero3 export <output_dir> <folder>` (what train prints when the final save wrote ZeRO shards): the
    output_dir has no marker, so the base model, license, ranks and hardware come from its newest complete
    checkpoint, the step from the finished record, the title from the output_dir's own name."""
    out = tmp_path / "outputs" / "my-run"
    folder = make_checkpoint(out, 8, marked=False)
    ckpt.write_marker(folder, {"world_size": 8, "hardware": {"ranks": 8, "device": "NVIDIA H200"},
                               "training_args": {"hub_license": "apache-2.0", "per_device_train_batch_size": 4},
                               "sources": {"base_model": "meta-llama/Llama-3.1-8B", "datasets": []}})
    (out / "trainer_state.json").write_text((folder / "trainer_state.json").read_text())
    ckpt.write_finished(out, {"global_step": 10, "zero_shards": "global_step10"})
    text = str(model_card(out, dtype="bf16"))
    assert "# my-run" in text and "base_model: meta-llama/Llama-3.1-8B" in text and "license: apache-2.0" in text
    assert "- Checkpoint: step 10, saved 20" in text and "- Hardware: 8 × NVIDIA H200" in text
    assert "trained from scratch" not in text


def test_the_card_of_a_preference_run_names_its_stage_beta_loss_and_reference(tmp_path):
    stage = ("stage dpo (TRL DPOTrainer) | loss sigmoid | beta 0.1 | reference: a second model (the policy's "
             "starting weights), inference-only DeepSpeed engine partitioned like the policy")
    text = _card(tmp_path, _marker(tmp_path, base_model="meta-llama/Llama-3.1-8B", datasets=[], stage=stage),
                 HISTORY).read_text()
    assert f"- Stage: {stage}" in text
