"""Every input of a run checked before anything starts, on every rank: the model, config and tokenizer folders,
the data, the ds_config against the TrainingArguments and the world size. All ranks stop, nothing is written, and
every problem shows at once, each naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from hf_zero3.config.check import check_ds_config, load_config
from hf_zero3.data.arguments import DataArguments, block_size_problem
from hf_zero3.data.errors import DataError
from hf_zero3.model import lora
from hf_zero3.run import model_checks, resume_checks, sequence_parallel
from hf_zero3.job.arguments import TrainingArguments, UsageError
from hf_zero3.job.distributed import is_world_process_zero, launched_world_size
from hf_zero3.job.preemption import DEFAULT_SIGNALS, parse_signals

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""A folder holding none of these has no tokenizer that AutoTokenizer can load."""


def _model_problems(values: dict[str, Any]) -> list[str]:
    """What is wrong with the model, config and tokenizer folders. A hub id is only tried when it loads."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    weights = {SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME}
    model, config = values.get("model_name_or_path"), values.get("config_name")
    if not (model or config):
        return ["no model given: set model_name_or_path (pretrained weights) or config_name (train from scratch)"]
    if model and values.get("config_overrides"):  # as HF's run_clm: the weights fix the shape they load into
        return [f"config_overrides ({values['config_overrides']}) reshape a config trained from scratch, but "
                f"model_name_or_path {model} loads pretrained weights: drop config_overrides (config_overrides null), "
                "or train from scratch with config_name"]
    tokenizer = "tokenizer_name" if values.get("tokenizer_name") else "model_name_or_path" if model else "config_name"
    problems = []
    for name, needs in (("model_name_or_path", "config.json weights"), ("config_name", "config.json"),
                        (tokenizer, "tokenizer")):
        value = values.get(name)
        if not value or (not os.path.exists(value) and not value.startswith((".", "/", "~")) and value.count("/") < 2):
            continue  # unset, or a hub id
        if not os.path.isdir(value):
            problems.append(f"{name} {value} {'is a file' if os.path.exists(value) else 'does not exist'}: point it "
                            "at a model folder (config.json inside) or a hub id like org/name")
            continue
        try:
            files = set(os.listdir(value))
            for file in files & {"config.json", *TOKENIZER_FILES}:
                with open(os.path.join(value, file), "rb"):  # a real open: os.access says yes to root
                    pass
        except OSError as e:
            problems.append(f"{name} {value}: {e.filename} cannot be read ({e.strerror}): fix its permissions")
            continue
        if "config.json" in needs and "config.json" not in files:
            problems.append(f"{name} {value} has no config.json: point it at the folder save_pretrained wrote "
                            "(config.json, weights, tokenizer), not its parent or a copy of some of its files")
        elif "weights" in needs and not files & weights:
            problems.append(f"{name} {value} has a config.json but no weights ({', '.join(sorted(weights))}): to "
                            "train from scratch pass it as config_name instead; to fine-tune, point it at the folder "
                            "with the weights")
        elif needs == "tokenizer" and not files & set(TOKENIZER_FILES):
            problems.append(f"{name} {value} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): set "
                            "tokenizer_name to the folder or hub id of the model's tokenizer")
    return problems


def training_values(values: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments values by name, defaults filled in, before the TrainingArguments object (and with it the
    DeepSpeed bridge and the device set-up) exists."""
    fields = [f for f in dataclasses.fields(TrainingArguments) if f.init and f.default is not dataclasses.MISSING]
    return {**{f.name: f.default for f in fields}, **values}


def _ds_config_problems(values: dict[str, Any], device: str) -> list[str]:
    """`hf-zero3 config check` on the ds_config with these TrainingArguments and this world size; warnings are
    printed (rank 0), errors returned."""
    source = values.get("deepspeed")
    if not source:
        return []
    name = "ds_config (inline)" if isinstance(source, dict) else f"ds_config {source}"
    try:
        config = source if isinstance(source, dict) else load_config(source)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    findings = check_ds_config(config, world_size=launched_world_size(), device=device,
                               training_args=training_values(values))
    if is_world_process_zero():
        for finding in findings:
            if finding.level == "warning":
                print(f"warning: {name}: {finding.key}: {finding.message}", file=sys.stderr, flush=True)
    return [f"{name}: {f.key}: {f.message}" for f in findings if f.level == "error"]


def _local_config(values: dict[str, Any]):
    """The model's config alone (a local folder, or a hub id already in the cache), with config_overrides applied;
    None when it cannot be known before loading."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(values.get("model_name_or_path") or values.get("config_name"),
                                            local_files_only=True, trust_remote_code=bool(values.get("trust_remote_code")))
        if values.get("config_overrides"):
            config.update_from_string(values["config_overrides"])
    except (OSError, ValueError):
        return None
    return config


def _max_positions(values: dict[str, Any]) -> int | None:
    return getattr(_local_config(values), "max_position_embeddings", None)


def _config_problems(values: dict[str, Any]) -> list[str]:
    """The fields of the model's config that its forward would trip on (`hf_zero3.run.model_checks`)."""
    config = _local_config(values)
    source = values.get("model_name_or_path") or values.get("config_name")
    return [] if config is None else model_checks.problems(config, source)


def check_inputs(values: dict[str, Any], device: str) -> None:
    """Every input (model folders, data files or dataset, the ds_config against TrainingArguments and the world size),
    checked on every rank before anything starts: all ranks stop, nothing is written, and all problems show at once."""
    problems = ["fp16 is not supported on CPU: drop --fp16 (fp32) or use --bf16 true"] \
        if device == "cpu" and values.get("fp16") else []
    problems += _model_problems(values)
    problems += [] if problems else _config_problems(values)
    if not problems and (problem := block_size_problem(values.get("block_size", DataArguments.block_size),
                                                       _max_positions(values))):
        problems.append(problem)
    data, formats = _data_problems(values, with_tokenizer=not problems)
    problems += data
    if not problems and formats - {"text"} and values.get("packing", True):
        problems += _packing_problems(values)
    layers = values.get("gradient_checkpointing_layers")
    if layers is not None and not (values.get("gradient_checkpointing") or values.get("activation_checkpointing")):
        problems.append(f"gradient_checkpointing_layers {layers} needs gradient_checkpointing true: it chooses which "
                        "layers checkpointing covers; set gradient_checkpointing true or drop gradient_checkpointing_layers")
    elif layers is not None and int(layers) < 1:
        problems.append(f"gradient_checkpointing_layers must be >= 1 (got {layers}): to checkpoint no layer set "
                        "gradient_checkpointing false and drop gradient_checkpointing_layers")
    problems += _compile_problems(values)
    steps, epochs = (training_values(values)[k] for k in ("max_steps", "num_train_epochs"))
    if steps <= 0 and epochs <= 0:
        problems.append(f"nothing to train: max_steps is {steps} and num_train_epochs is {epochs}; set max_steps to "
                        "the optimizer steps to train (or num_train_epochs > 0, with max_steps -1)")
    try:
        parse_signals(values.get("preemption_signals", DEFAULT_SIGNALS))
    except ValueError as e:
        problems.append(str(e))
    problems += _ds_config_problems(values, device)
    problems += lora.problems(values)
    problems += resume_checks.problems(values)
    problems += sequence_parallel.problems_of(values, launched_world_size())
    if values.get("fp8"):
        from hf_zero3.model import fp8  # torch: imported only when the option is used

        problems += fp8.problems(values, device)
    if problems:
        raise UsageError("\n".join(problems))


def _compile_problems(values: dict[str, Any]) -> list[str]:
    """regional_compile against the switches it cannot go with, and its backend."""
    from hf_zero3.model.regional_compile import BACKENDS  # torch: imported only when the option is used

    if not values.get("regional_compile"):
        return []
    problems = []
    if values.get("torch_compile") or values.get("torch_compile_backend") or values.get("torch_compile_mode"):
        problems.append("regional_compile and torch_compile both compile: torch_compile the whole model (its loss "
                        "too, which fails with Liger's fused cross-entropy), regional_compile each decoder layer; "
                        "set one of them")
    if values.get("regional_compile_backend", "inductor") not in BACKENDS:
        problems.append(f"regional_compile_backend {values['regional_compile_backend']!r}: choose one of "
                        f"{', '.join(BACKENDS)}")
    return problems


def _packing_problems(values: dict[str, Any]) -> list[str]:
    """Packed chat or prompt/completion data on a model whose attention would mix the examples of a block."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # datasets takes a second to import: `train --help` and argument errors come back without it
    from hf_zero3.data.packing import packing_problem

    try:
        config = AutoConfig.from_pretrained(values.get("model_name_or_path") or values.get("config_name"),
                                            local_files_only=True, trust_remote_code=bool(values.get("trust_remote_code")))
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (OSError, ValueError, KeyError):
        return []  # known once the model is built (remote code, a hub id not cached): checked again there
    problem = packing_problem(model_class, values.get("attn_implementation") or "sdpa")
    return [problem] if problem else []


def _data_problems(values: dict[str, Any], with_tokenizer: bool) -> tuple[list[str], set[str]]:
    """hf_zero3.data's checks of the data files, their formats and rows, and (`with_tokenizer`: the model's inputs
    are sound) the chat template on a sample; and the formats found."""
    from hf_zero3.data.build import data_problems  # as in _packing_problems
    from hf_zero3.run.stages import stage_problems

    if (staged := stage_problems(values)) is not None:  # a preference stage: its arguments, reference and rows
        return staged, set()

    def load_tokenizer():
        from transformers import AutoTokenizer

        name = values.get("tokenizer_name") or values.get("model_name_or_path") or values.get("config_name")
        try:
            return AutoTokenizer.from_pretrained(name, trust_remote_code=bool(values.get("trust_remote_code"))), name
        except (OSError, ValueError) as e:
            raise DataError(f"could not load the tokenizer {name} to check the chat data: {e}") from e

    return data_problems(values, load_tokenizer if with_tokenizer else None)
