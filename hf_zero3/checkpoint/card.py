"""The model card (README.md) of an export: Hub metadata, results, hyperparameters, hardware, versions.

Why huggingface_hub's ModelCard / ModelCardData / EvalResult and not a string template: the Hub reads the YAML
header (base_model links the fine-tune to its parent, datasets and model-index fill the model page), and these
classes write the keys and the model-index layout it expects. Built from the checkpoint's completion marker
(written by CheckpointGuardCallback) and its trainer_state.json; nothing from the machine that exports it, so no
local path, and only finite numbers (the card's YAML is read as JSON by the Hub).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hf_zero3 import __version__
from hf_zero3.checkpoint.lifecycle import checkpoint_step, newest_complete, read_finished, read_marker
from hf_zero3.job.facts import global_batch_of, precision_of
from hf_zero3.units import perplexity

DEFAULT_LICENSE = "other"
"""When no license was set (`hub_license`, `export --license`): the Hub's value for "see the card"."""

HUB = "https://huggingface.co"


def _history(checkpoint: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    except (OSError, ValueError, KeyError):
        return []


def _last(history: list[dict[str, Any]], key: str) -> tuple[float | None, int | None]:
    """The newest finite value of `key` in the log history, and its step."""
    rows = [r for r in history if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return (rows[-1][key], rows[-1].get("step")) if rows else (None, None)


def hub_id(name: Any) -> str | None:
    """`name` if it is a Hub repo id (ORG/NAME or NAME) and not a local folder, else None: what may go into
    base_model and datasets (a local path must never reach the card)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(name, str) or not name or os.path.isabs(name) or name.startswith(".") or os.path.exists(name):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def hyperparameters(training: dict[str, Any], world_size: int, ds_config: dict[str, Any] | None) -> dict[str, Any]:
    """The short list the Trainer's own card gives, from the recorded TrainingArguments (not all 100 of them)."""
    batch = SimpleNamespace(per_device_train_batch_size=training.get("per_device_train_batch_size", 1),
                            gradient_accumulation_steps=training.get("gradient_accumulation_steps", 1),
                            world_size=world_size,
                            sequence_parallel_size=training.get("sequence_parallel_size") or 1)
    rows: dict[str, Any] = {
        "learning_rate": training.get("learning_rate"),
        "train_batch_size": batch.per_device_train_batch_size,
        "seed": training.get("seed"),
        "distributed_type": "DeepSpeed ZeRO-3" if ds_config else "multi-process",
        "num_devices": world_size,
        "sequence_parallel_size": batch.sequence_parallel_size if batch.sequence_parallel_size > 1 else None,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "total_train_batch_size": global_batch_of(batch),
        "optimizer": training.get("optim"),
        "lr_scheduler_type": training.get("lr_scheduler_type"),
        "lr_scheduler_warmup_steps": training.get("warmup_steps") or None,
        "training_steps": training.get("max_steps") if (training.get("max_steps") or 0) > 0 else None,
        "num_epochs": training.get("num_train_epochs") if (training.get("max_steps") or 0) <= 0 else None,
        "precision": precision_of(training.get("bf16"), training.get("fp16")),
        "max_grad_norm": training.get("max_grad_norm"),
    }
    zero = (ds_config or {}).get("zero_optimization") or {}
    for key, name in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        device = (zero.get(key) or {}).get("device")
        if device and device != "none":
            rows[name] = device
    return {k: v for k, v in rows.items() if v is not None and not (isinstance(v, float) and not math.isfinite(v))}


def _hardware(marker: dict[str, Any]) -> str:
    hardware = marker.get("hardware") or {}
    ranks = hardware.get("ranks") or marker.get("world_size")
    device = hardware.get("device") or "unknown device"
    return f"{ranks} × {device}" if ranks else device


def _lora(checkpoint: Path) -> dict[str, Any]:
    """The LoRA settings of a saved adapter (its adapter_config.json), {} for a full model."""
    try:
        config = json.loads((checkpoint / "adapter_config.json").read_text())
        return config if isinstance(config, dict) else {}
    except (OSError, ValueError):
        return {}


def _lora_text(lora: dict[str, Any]) -> str:
    targets = lora.get("target_modules")
    targets = ", ".join(sorted(targets)) if isinstance(targets, list) else str(targets)
    return f"LoRA adapter (rank {lora.get('r')}, alpha {lora.get('lora_alpha')}, on {targets})"


def model_card(checkpoint: str | os.PathLike, dtype: str, license: str | None = None,
               model_name: str | None = None, kind: str = "model", base_model: str | None = None):
    """The `huggingface_hub.ModelCard` for the export of `checkpoint` (`str(card)` is the README.md).

    `kind`: "model" (every weight trained), "adapter" (a LoRA run's adapter folder) or "merged" (the base with the
    adapter merged in). `base_model`: the base's hub id when the run's own record does not give one."""
    from huggingface_hub import ModelCard

    checkpoint = Path(checkpoint)
    # A finished output_dir (its final save wrote ZeRO shards) has no marker of its own: the run's provenance is in
    # its newest complete checkpoint's, its step in the finished record, its name is its own.
    finished = read_finished(checkpoint) if read_marker(checkpoint) is None else None
    source = (newest_complete(checkpoint) if finished else None) or checkpoint
    marker = read_marker(source) or {}
    sources = marker.get("sources") or {}
    history = _history(checkpoint)
    lora = _lora(checkpoint) if kind != "model" else {}
    base_model = hub_id(base_model) or hub_id(sources.get("base_model")) or hub_id(lora.get("base_model_name_or_path"))
    datasets = [d for d in map(hub_id, sources.get("datasets") or []) if d]
    name = model_name or (checkpoint.name if finished else checkpoint.parent.name) or "model"
    eval_loss, eval_step = _last(history, "eval_loss")
    data = _card_data(marker, kind, name, base_model, datasets, eval_loss, license, bool(lora))
    lines = [f"# {name}", "", _intro(kind, base_model, datasets, bool(sources.get("base_model") or lora), lora), ""]
    if eval_loss is not None:
        lines += [f"It achieves the following results on the evaluation set (step {eval_step}):",
                  f"- Loss: {eval_loss:.4f}", f"- Perplexity: {perplexity(eval_loss):.4f}", ""]
    lines += _procedure(checkpoint, marker, finished, history, dtype, kind)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def _card_data(marker: dict, kind: str, name: str, base_model: str | None, datasets: list[str],
               eval_loss: float | None, license: str | None, lora: bool):
    """The card's metadata: base model, datasets, license, library, the evaluation results, the tags."""
    from huggingface_hub import EvalResult, ModelCardData

    recipe = marker.get("recipe") or {}
    results = []
    if eval_loss is not None:
        where = {"task_type": "text-generation", "task_name": "Causal Language Modeling",
                 "dataset_type": datasets[0] if datasets else "text",
                 "dataset_name": datasets[0] if datasets else "held-out validation text"}
        results = [EvalResult(metric_type="loss", metric_name="Eval loss", metric_value=round(eval_loss, 4), **where),
                   EvalResult(metric_type="perplexity", metric_name="Perplexity",
                              metric_value=round(perplexity(eval_loss), 4), **where)]
    return ModelCardData(
        base_model=base_model, datasets=datasets or None,
        license=license or (marker.get("training_args") or {}).get("hub_license") or DEFAULT_LICENSE,
        library_name="peft" if kind == "adapter" else "transformers",
        pipeline_tag="text-generation", model_name=name, eval_results=results or None,
        tags=["hf_zero3", "deepspeed", "zero3", "generated_from_trainer"] + (["lora"] if lora else [])
        + ([f"recipe:{recipe['name']}"] if recipe.get("name") else []))


def _intro(kind: str, base_model: str | None, datasets: list[str], local_base: bool, lora: dict) -> str:
    """What the weights are (fine-tuned from what, on what; an adapter, merged or not) and how to load them."""
    origin = (f"a fine-tuned version of [{base_model}]({HUB}/{base_model})" if base_model
              else "fine-tuned from a local model" if local_base else "trained from scratch")
    on = f" on {', '.join(f'[{d}]({HUB}/datasets/{d})' for d in datasets)}" if datasets else ""
    if kind == "merged":
        return (f"This model is {origin}{on}: a {_lora_text(lora)} trained with DeepSpeed ZeRO-3 and the Hugging "
                "Face Trainer through hf_zero3, merged into the base weights. Load it with "
                "`AutoModelForCausalLM.from_pretrained` or `pipeline(\"text-generation\")`.")
    if kind == "adapter":
        of = f"[{base_model}]({HUB}/{base_model})" if base_model else "a local base model"
        load = base_model or "BASE_MODEL"
        return (f"This is a {_lora_text(lora)} for {of}{on}, trained with DeepSpeed ZeRO-3 and the Hugging Face "
                f"Trainer through hf_zero3. Load it with peft: `PeftModel.from_pretrained(AutoModelForCausalLM."
                f"from_pretrained(\"{load}\"), \"THIS_REPO\")`, or merge it with `hf-zero3 export --merge`.")
    return (f"This model is {origin}{on}, with DeepSpeed ZeRO-3 and the Hugging Face Trainer through hf_zero3. "
            "Load it with `AutoModelForCausalLM.from_pretrained` or `pipeline(\"text-generation\")`.")


def _procedure(checkpoint: Path, marker: dict, finished: dict | None, history: list, dtype: str,
               kind: str) -> list[str]:
    """The training procedure: recipe, checkpoint, final loss, weights, hyperparameters, hardware, versions."""
    training, recipe, speed = marker.get("training_args") or {}, marker.get("recipe") or {}, marker.get("throughput") or {}
    sources = marker.get("sources") or {}
    step = finished.get("global_step") if finished else checkpoint_step(checkpoint)
    loss, loss_step = _last(history, "loss")
    lines = ["## Training procedure", ""]
    recipe_text = f"`{recipe['name']}` {recipe.get('version') or ''}".strip() if recipe.get("name") else "none (custom)"
    masters = "the fp32 master weights (DeepSpeed zero_to_fp32)"
    weights = {"model": f"- Weights: {dtype}, from {masters}",
               "adapter": f"- Adapter weights: {dtype}, from "
                          f"{masters if (checkpoint / 'latest').is_file() else 'the adapter the run saved'}",
               "merged": f"- Weights: {dtype}, the base's with the adapter merged in"}[kind]
    lines += [f"- Recipe: {recipe_text}",
              f"- Checkpoint: step {step}, saved {(finished or marker).get('finished_at' if finished else 'written_at', 'at an unknown time')}",
              f"- Final training loss: {loss:.4f} (step {loss_step})" if loss is not None else
              "- Final training loss: not logged",
              weights, *([f"- Stage: {sources['stage']}"] if sources.get("stage") else []), ""]
    lines += ["### Training hyperparameters", "", "The following hyperparameters were used during training:", ""]
    world_size = int(marker.get("world_size") or (marker.get("hardware") or {}).get("ranks") or 1)
    lines += [f"- {k}: {v}" for k, v in hyperparameters(training, world_size, marker.get("ds_config")).items()]
    lines += ["", "### Hardware and throughput", "", f"- Hardware: {_hardware(marker)}"]
    if speed:
        lines.append(f"- Throughput: {speed['samples_per_second']:.2f} samples/s, {speed['steps_per_second']:.3f} "
                     f"steps/s (measured over {speed['measured_over_steps']} steps)")
    else:
        lines.append("- Throughput: not measured")
    lines += ["", "### Framework versions", "", f"- hf_zero3 {marker.get('hf_zero3_version') or __version__}"]
    versions = marker.get("versions") or {}
    lines += [f"- {k} {v}" for k, v in versions.items() if k != "hf_zero3"]
    return lines
