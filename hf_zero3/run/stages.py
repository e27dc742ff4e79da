"""The training stages: each a row naming TRL's trainer and config, the columns its data needs, whether it keeps a
reference model; and the checks of a stage's own arguments (`stage_args`) before anything starts.

`stage_args` holds TRL's own arguments of the stage's config (DPOConfig's `beta`, `loss_type`, ...), by TRL's names,
passed through strictly: a key the config does not have is an error naming the nearest one. The TrainingArguments
fields stay where they are (top level); `max_length` is block_size's, set from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
from dataclasses import dataclass
from typing import Any

from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.errors import DataError
from hf_zero3.data.loading import load_file
from hf_zero3.data.preference import PAIRS, UNPAIRED, Columns, load_checked, row_problems

SET_BY_US = {"max_length": "block_size", "dataset_num_proc": "preprocessing_num_workers",
             "model_init_kwargs": "model_name_or_path / dtype / attn_implementation",
             "ref_model_init_kwargs": "ref_model_name_or_path"}
"""Config fields the run sets from its own arguments: the argument to set instead."""


@dataclass(frozen=True)
class Stage:
    """One training method: TRL's trainer and config ("module:Class"), its data's columns, its reference model."""

    name: str
    trainer: str
    config: str
    columns: Columns | None
    """None: SFT's formats (text, chat, prompt/completion; hf_zero3.data.build)."""
    reference: bool
    """Whether the trainer compares against a reference model (none for ORPO/SimPO, reference-free)."""

    def config_class(self) -> type:
        module, name = self.config.split(":")
        return getattr(importlib.import_module(module), name)

    def trainer_class(self) -> type:
        module, name = self.trainer.split(":")
        return getattr(importlib.import_module(module), name)


STAGES = {stage.name: stage for stage in (
    Stage("sft", "trl:SFTTrainer", "trl:SFTConfig", None, reference=False),
    Stage("dpo", "trl:DPOTrainer", "trl:DPOConfig", PAIRS, reference=True),
    Stage("orpo", "trl.experimental.orpo:ORPOTrainer", "trl.experimental.orpo:ORPOConfig", PAIRS, reference=False),
    Stage("simpo", "trl.experimental.cpo:CPOTrainer", "trl.experimental.cpo:CPOConfig", PAIRS, reference=False),
    Stage("kto", "trl:KTOTrainer", "trl:KTOConfig", UNPAIRED, reference=True),
)}
"""SimPO is TRL's CPOTrainer with loss_type simpo (set by default for this stage)."""

STAGE_DEFAULTS = {"simpo": {"loss_type": "simpo", "cpo_alpha": 0.0}}
"""TRL fields a stage sets unless `stage_args` says otherwise."""

TRAINING_DEFAULTS = {"kto": {"train_sampling_strategy": "sequential"}}
"""Training arguments a stage needs other than transformers' default, used while the run leaves them at that default
(KTO's loss pairs each example with its neighbours in a fixed-order batch)."""


def stage_of(values: dict[str, Any]) -> Stage:
    name = values.get("stage") or "sft"
    if name not in STAGES:
        near = difflib.get_close_matches(str(name), STAGES, n=1)
        raise ValueError(f"stage {name!r} is not one of {', '.join(STAGES)}" + (f" (did you mean {near[0]}?)"
                                                                                if near else ""))
    return STAGES[name]


def own_fields(stage: Stage) -> dict[str, dataclasses.Field]:
    """The config's fields that TrainingArguments does not have: what `stage_args` may set."""
    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {f.name: f for f in dataclasses.fields(stage.config_class()) if f.name not in base and f.init}


def loss_types(field: dataclasses.Field) -> tuple[str, ...]:
    """The loss types TRL accepts, read from the field: its `choices`, or the values its help lists."""
    if choices := field.metadata.get("choices"):
        return tuple(choices)
    return tuple(re.findall(r"`'([a-z_0-9]+)'`", field.metadata.get("help", "")))


def _key_problem(key: str, stage: Stage, fields: dict) -> str | None:
    from transformers import TrainingArguments

    if key in SET_BY_US:
        return f"stage_args.{key} is set from {SET_BY_US[key]}: set that instead"
    if key in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return f"stage_args.{key} is a training argument: set {key} at the top level of the YAML"
    if key not in fields:
        near = difflib.get_close_matches(key, fields, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return (f"stage_args.{key} is not an argument of TRL's {stage.config.split(':')[1]}{hint}: fix the spelling "
                "or remove it")
    return None


def _value_problems(args: dict[str, Any], stage: Stage, fields: dict, values: dict[str, Any]) -> list[str]:
    problems = []
    beta = args.get("beta")
    if beta is not None and (not isinstance(beta, (int, float)) or beta <= 0):
        problems.append(f"stage_args.beta is {beta!r}: it must be a number > 0 (TRL's default is 0.1; smaller "
                        "lets the policy move further from the reference)")
    if "loss_type" in args and (known := loss_types(fields["loss_type"])):
        given = args["loss_type"] if isinstance(args["loss_type"], list) else [args["loss_type"]]
        for loss in given:
            if loss not in known:
                near = difflib.get_close_matches(str(loss), known, n=1)
                problems.append(f"stage_args.loss_type {loss!r} is not one of TRL's {', '.join(known)}"
                                + (f" (did you mean {near[0]}?)" if near else "") + ": use one of these")
    if args.get("precompute_ref_log_probs") and args.get("sync_ref_model"):
        problems.append("stage_args.precompute_ref_log_probs with sync_ref_model: a synced reference changes during "
                        "training, so log-probs computed before it are stale; set one of them false")
    if stage.reference and values.get("peft") and args.get("sync_ref_model"):
        problems.append("stage_args.sync_ref_model with peft: with LoRA the reference is the base with the adapter "
                        "off, there is no second model to sync; set sync_ref_model false or drop peft")
    return problems


def stage_arg_problems(values: dict[str, Any]) -> list[str]:
    """Everything wrong with `stage` and `stage_args`, one line each naming the fix."""
    try:
        stage = stage_of(values)
    except ValueError as e:
        return [f"{e}: set stage to one of them"]
    args = values.get("stage_args") or {}
    if not isinstance(args, dict):
        return [(f"stage_args is {args!r}: give a mapping of TRL's {stage.config.split(':')[1]} arguments, e.g. "
                 "{beta: 0.1}")]
    if stage.name == "sft":
        return [("stage_args is for the preference stages (dpo, orpo, simpo, kto): set stage, or move TRL's SFT "
                 "arguments to the top level")] if args else []
    if values.get("ref_model_name_or_path") and not stage.reference:
        return [f"ref_model_name_or_path: stage {stage.name} is reference-free; remove it or use stage dpo or kto"]
    if values.get("ref_model_name_or_path") and values.get("peft"):
        return [("ref_model_name_or_path with peft: a LoRA run's reference is its base with the adapter disabled; "
                 "remove ref_model_name_or_path, or drop peft to train against another reference")]
    fields = own_fields(stage)
    problems = [p for key in args if (p := _key_problem(key, stage, fields))]
    return problems or _value_problems(args, stage, fields, values)


def reference_problem(policy_config, reference_config, name: str) -> str | None:
    """A reference model that cannot score the policy's tokens the same way: another vocabulary or shape."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "model_type")
    differ = [f"{k} {getattr(reference_config, k, None)} vs {getattr(policy_config, k, None)}" for k in keys
              if getattr(reference_config, k, None) != getattr(policy_config, k, None)]
    if not differ:
        return None
    return (f"ref_model_name_or_path {name} is not a model of the policy's vocabulary and shape ({'; '.join(differ)}):"
            " use the policy's own starting weights (leave ref_model_name_or_path unset) or a model of the same family")


def _reference_config_problem(values: dict[str, Any]) -> str | None:
    from transformers import AutoConfig

    reference = values.get("ref_model_name_or_path")
    policy = values.get("model_name_or_path") or values.get("config_name")
    if not reference or not policy:
        return None
    try:
        return reference_problem(AutoConfig.from_pretrained(policy), AutoConfig.from_pretrained(reference), reference)
    except (OSError, ValueError) as e:
        return f"ref_model_name_or_path {reference} could not be read ({e}): use a local model folder"


def stage_problems(values: dict[str, Any]) -> list[str] | None:
    """The stage's arguments, reference model and data checked (one line each); None for sft with nothing wrong in
    its stage arguments (SFT's own data checks apply)."""
    problems = stage_arg_problems(values)
    stage = STAGES.get(values.get("stage") or "sft")
    if stage is None or stage.columns is None:
        return problems or None
    if problem := _reference_config_problem(values):
        problems.append(problem)
    try:
        data_args = DataArguments(**{k: v for k, v in values.items() if k in DataArguments.__dataclass_fields__})
        load_checked(data_args, stage.columns)
        if data_args.validation_file:
            row_problems(load_file(data_args.validation_file, "validation_file"), stage.columns, "validation_file")
    except DataError as e:
        problems.append(str(e))
    return problems
