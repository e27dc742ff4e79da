"""What a checkpoint was trained as, against what this run would resume it as: checked before anything starts.

Why: a mismatch is knowable from the checkpoint's own record (its marker, its adapter_config.json, its config.json),
but otherwise shows only deep inside a load: a LoRA checkpoint resumed without its `peft:` block dies in DeepSpeed
with kilobytes of state-dict keys; a full fine-tune's resumed with one ends in a KeyError; a checkpoint of another
ZeRO stage or model shape fails as obscurely. One table (`TRAITS`): a new trait of a run (sequence-parallel degree,
a preference-tuning method) is one row: how the checkpoint says it, how this run says it, and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_zero3.checkpoint import contents
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.config.check import load_config


def resume_target(values: dict[str, Any]) -> Path | None:
    """The checkpoint this run would resume: the folder given, or with `auto` the newest complete one in output_dir
    (every checkpoint there is of the same run); None when it starts from scratch or the folder is not there (said
    elsewhere)."""
    resume, output_dir = values.get("resume_from_checkpoint"), values.get("output_dir")
    if resume in (None, "", False):
        return None
    if resume == "auto":
        return ckpt.newest_complete(output_dir) if output_dir and Path(output_dir).is_dir() else None
    return Path(resume) if Path(resume).is_dir() else None


def _saved_kind(checkpoint: Path) -> str | None:
    if (checkpoint / contents.ADAPTER_CONFIG).is_file():
        return "adapter"
    return "full" if (checkpoint / "config.json").is_file() else None


def _run_kind(values: dict[str, Any]) -> str:
    return "full" if values.get("peft") is None else "adapter"


def _kind_fix(checkpoint: Path, saved: str, wanted: str) -> str:
    if saved == "adapter":
        config = json.loads((checkpoint / contents.ADAPTER_CONFIG).read_text())
        block = {k: config.get(k) for k in ("r", "lora_alpha", "target_modules") if config.get(k) is not None}
        return (f"{checkpoint} is a LoRA adapter's checkpoint ({contents.ADAPTER_CONFIG}: {block}) and this run has no "
                "peft: block: resume it with the peft: block of the run that saved it, or train the full model in "
                "another output_dir")
    return (f"{checkpoint} is a full fine-tune's checkpoint (every weight trained, no {contents.ADAPTER_CONFIG}) and this "
            "run has a peft: block: resume it without the peft: block (--peft null), or train the adapter in another "
            "output_dir")


def _saved_stage(checkpoint: Path) -> int | None:
    if contents.universal_tag(checkpoint) is not None:  # a universal checkpoint loads into any stage
        return None
    config = (ckpt.read_marker(checkpoint) or {}).get("ds_config") or {}
    return (config.get("zero_optimization") or {}).get("stage") if isinstance(config, dict) else None


def _run_stage(values: dict[str, Any]) -> int | None:
    source = values.get("deepspeed")
    try:
        config = source if isinstance(source, dict) else load_config(source) if source else None
    except (FileNotFoundError, ValueError):
        return None  # said by the ds_config check
    return ((config or {}).get("zero_optimization") or {}).get("stage")


def _stage_fix(checkpoint: Path, saved: int, wanted: int) -> str:
    return (f"{checkpoint} was saved by ZeRO stage {saved} and this run's ds_config has stage {wanted}: DeepSpeed "
            f"cannot load one stage's partitions into another. Resume with a ds_config of stage {saved} (the one of "
            f"the run that saved it: its {ckpt.MARKER} holds it), or `hf-zero3 reshard {checkpoint}` once and "
            'resume with "checkpoint": {"load_universal": true}')


@dataclass(frozen=True)
class Trait:
    """One thing a checkpoint was trained as: how the checkpoint says it, how this run says it (None: unknown, not
    compared) and the line naming the difference and the fix."""

    name: str
    saved: Callable[[Path], Any]
    wanted: Callable[[dict[str, Any]], Any]
    fix: Callable[[Path, Any, Any], str]


TRAITS = (
    Trait("full or adapter", _saved_kind, _run_kind, _kind_fix),
    Trait("ZeRO stage", _saved_stage, _run_stage, _stage_fix),
)


def _shape_problem(checkpoint: Path, values: dict[str, Any]) -> list[str]:
    """The model's shape against the checkpoint's config.json, from this run's config alone (a local folder or a
    cached hub id; otherwise the check after the config loads says it)."""
    from transformers import (
        AutoConfig,  # seconds to import: `train --help` and argument errors come back without it
    )

    source = values.get("model_name_or_path") or values.get("config_name")
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True,
                                            trust_remote_code=bool(values.get("trust_remote_code")))
        if values.get("config_overrides"):
            config.update_from_string(values["config_overrides"])
    except (OSError, ValueError, TypeError):
        return []
    if not (differences := contents.shape_difference(checkpoint, config)):
        return []
    return [(f"{checkpoint} holds a model of another shape than this run's: {'; '.join(differences)}. Resume with "
             "the model it was saved from (the model_name_or_path or config_name and config_overrides of that run: "
             f"its config is {checkpoint}/config.json), or train this model in another output_dir")]


def problems(values: dict[str, Any]) -> list[str]:
    """Each way the checkpoint this run would resume was trained otherwise than this run would go on, with the fix."""
    checkpoint = resume_target(values)
    if checkpoint is None:
        return []
    found = []
    for trait in TRAITS:
        saved, wanted = trait.saved(checkpoint), trait.wanted(values)
        if saved is not None and wanted is not None and saved != wanted:
            found.append(f"resume_from_checkpoint: {trait.fix(checkpoint, saved, wanted)}")
    if not found:
        found = _shape_problem(checkpoint, values)
    return found
