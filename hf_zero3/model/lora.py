"""LoRA from the recipe's `peft:` block: peft's own `LoraConfig` fields, checked by building the LoraConfig before
anything starts, the adapter the planner counts for it, and the adapter put on the model the run built.

Why here and not in the Trainer: the base is loaded under ZeRO-3 (partitioned as it loads), then peft adds the
adapter layers; DeepSpeed partitions those when the engine starts, and its optimizer gets only what requires grad
(the adapter). Gradient checkpointing with a frozen base needs the non-reentrant checkpoint: the reentrant one
sees inputs that do not require grad and gives the adapter no gradient. What a save must hold and how it is
checked: hf_zero3/callbacks/adapter_check.py; export and merge: hf_zero3/checkpoint/export.py; docs/lora.md.
"""

from __future__ import annotations

import dataclasses
import difflib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import Version

from hf_zero3.plan.lora import LINEAR_LAYERS, adapter
from hf_zero3.plan.types import Adapter

ALL_LINEAR = "all-linear"
"""peft's name for every linear layer of the decoder (the output layer, lm_head, excepted)."""


DEFAULTS = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ALL_LINEAR}
"""What a `peft:` block leaves out; any other field takes peft's own default."""

RENAMED = {"alpha": "lora_alpha", "dropout": "lora_dropout", "rank": "r", "lora_r": "r", "target": "target_modules"}
"""Names this block once took (or near misses) -> peft's own, named in the error."""

CHECKS = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1, e.g. 16"),
    "lora_alpha": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v > 0,
                   "a number > 0 (the update is scaled by lora_alpha / r), e.g. 32"),
    "lora_dropout": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1,
                     "a fraction in [0, 1), e.g. 0.05"),
    "target_modules": (lambda v: v == ALL_LINEAR or (isinstance(v, list) and v and all(isinstance(x, str) for x in v)),
                       f'"{ALL_LINEAR}" or a list of module names, e.g. [q_proj, k_proj, v_proj, o_proj]'),
}
"""The values peft accepts but would train badly with (or fail on later), with the fix named in the error."""


def _field_problems(value: dict, fields: set[str]) -> list[str]:
    lines = []
    for name, given in value.items():
        if name in RENAMED:
            lines.append(f"peft.{name}: peft calls it {RENAMED[name]}: write {RENAMED[name]}: {given}")
        elif name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            lines.append(f"peft.{name}: not a field of peft's LoraConfig{f' (did you mean {close[0]}?)' if close else ''}"
                         f": use its names (r, lora_alpha, lora_dropout, target_modules, ...)")
        elif name in CHECKS and not CHECKS[name][0](given):
            lines.append(f"peft.{name}: got {given!r}: give {CHECKS[name][1]}")
    return lines


def parse(value: Any):
    """The `peft:` value (a mapping of peft's `LoraConfig` fields, or None: no LoRA) as the `peft.LoraConfig` the
    run applies; ValueError naming each bad field and its fix (an old name: the new one)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"peft must be a mapping of peft's LoraConfig fields, not {value!r}: e.g. "
                         "peft: {r: 16, lora_alpha: 32, lora_dropout: 0.05, target_modules: all-linear}")
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise ValueError(import_failure(e)) from e
    fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init} - {"task_type"}
    if lines := _field_problems(value, fields):
        raise ValueError("\n".join(lines))
    try:
        return LoraConfig(**{**DEFAULTS, **value, "task_type": "CAUSAL_LM"})
    except (TypeError, ValueError) as e:  # peft's own checks of its fields
        raise ValueError(f"peft: {e}") from None


def planned(shape, block: dict | None, r: int | None = None, dropout: float | None = None) -> Adapter | None:
    """The adapter a `peft:` block (or `r` alone) puts on a model of `shape`, as the planner counts it: the one
    owner for train's advice, the launcher's dry run and `hf-zero3 plan`; `dropout` overrides the block's."""
    if r:
        block = {"r": r}
    if block is None:
        return None
    config = parse(block if dropout is None else {**block, "lora_dropout": dropout})
    targets = config.target_modules if isinstance(config.target_modules, str) else sorted(config.target_modules)
    return adapter(shape, config.r, targets, config.lora_dropout)


def unmatched_targets(config, module_names: list[str]) -> list[str]:
    """The target names that match no module (peft matches a name to a module whose name ends in `.name`)."""
    if isinstance(config.target_modules, str):
        return []
    return sorted(t for t in config.target_modules if not any(m == t or m.endswith(f".{t}") for m in module_names))


PEFT_FOR_TORCHAO = {"0.18": "0.19"}
"""torchao release -> the first peft that works beside it. peft before 0.19 imports `LinearActivationQuantizedTensor`
from torchao.quantization for every layer it adapts, whenever torchao is installed; torchao 0.18 no longer has it, so
`get_peft_model` raises ImportError on any model (seen with peft 0.18.1 and torchao 0.18.0)."""
FIX_TORCHAO = "`pip uninstall torchao` (LoRA does not need it) or `pip install 'peft>={peft}'`"


def torchao_conflict(installed: dict[str, str] | None = None) -> tuple[str, str] | None:
    """(what fails, the fix) when the installed peft and torchao (or `installed`: {"peft": version, "torchao":
    version}) are a pair peft's LoRA fails with (package metadata only: nothing is imported); None when they work
    together or either is absent."""
    try:
        installed = installed or {name: version(name) for name in ("peft", "torchao")}
    except PackageNotFoundError:
        return None
    for torchao, peft in PEFT_FOR_TORCHAO.items():
        if Version(installed["torchao"]) >= Version(torchao) and Version(installed["peft"]) < Version(peft):
            return (f"peft {installed['peft']} cannot put a LoRA adapter on a model while torchao "
                    f"{installed['torchao']} is installed (it imports LinearActivationQuantizedTensor from "
                    f"torchao.quantization, which torchao {torchao} removed)", FIX_TORCHAO.format(peft=peft))
    return None


def torchao_problem(installed: dict[str, str] | None = None) -> str | None:
    """`torchao_conflict` as one message naming the fix."""
    conflict = torchao_conflict(installed)
    return f"{conflict[0]}: {conflict[1]}" if conflict else None


def import_failure(error: ImportError) -> str:
    """An ImportError raised inside peft as the message a user acts on: the versions of peft and torchao (which peft
    imports when it is installed) and the fix."""
    if known := torchao_problem():
        return known
    found = {}
    for name in ("peft", "torchao"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    fix = (f"`pip uninstall torchao` (LoRA does not need it) or a peft release that supports torchao "
           f"{found['torchao']} (`pip install -U peft`)" if found["torchao"] != "not installed"
           else "reinstall peft and its dependencies (`pip install --force-reinstall peft`)")
    return (f"peft {found['peft']} failed to import what LoRA needs ({error}); torchao: {found['torchao']}. "
            f"Fix: {fix}")


def problems(values: dict[str, Any]) -> list[str]:
    """What is wrong with the `peft:` block of these arguments, before anything starts (every rank)."""
    if values.get("peft") is None:
        return []
    try:
        config = parse(values["peft"])
    except ValueError as e:
        return str(e).splitlines()
    if known := torchao_problem():
        return [f"peft: {known}"]
    if not values.get("model_name_or_path"):
        return ["peft trains a LoRA adapter on pretrained weights, but no model_name_or_path is set: set it to the "
                "base model (a folder or hub id), or drop the peft block to train every weight"]
    names = _module_names(values)
    if names is not None and (missing := unmatched_targets(config, list(names))):
        linear = sorted({n.rsplit(".", 1)[-1] for n, kind in names.items() if kind == "Linear"})
        return [f"peft.target_modules: {', '.join(missing)} match(es) no module of {values['model_name_or_path']}: "
                f"its linear layers are {', '.join(linear)} (or use {ALL_LINEAR})"]
    return []


def _module_names(values: dict[str, Any]) -> dict[str, str] | None:
    """{module name: class name} of the model, built on the meta device from its config (no weights, no memory);
    None when the config cannot be read here (a hub id not cached: peft checks the names when it applies)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(values["model_name_or_path"], local_files_only=True,
                                            trust_remote_code=bool(values.get("trust_remote_code")))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=bool(values.get("trust_remote_code")))
    except (OSError, ValueError, KeyError):
        return None
    return {name: type(module).__name__ for name, module in model.named_modules() if name}


def apply(model, config, training_args):
    """`model` with the adapter of `config` (`parse`'s LoraConfig; a peft PeftModel, the base frozen). Gradient checkpointing is switched to
    the non-reentrant checkpoint unless the arguments chose one. ValueError when peft refuses the targets, or when
    peft fails on an import (named with peft's and torchao's versions and the fix, `import_failure`).

    The adapter's dtype: peft makes it fp32 on a 16-bit base (`autocast_adapter_dtype`) and casts each adapted
    layer's input to fp32, for runs whose optimizer updates the very weights the model computes with. DeepSpeed's
    optimizer updates fp32 master weights of its own, so under DeepSpeed the adapter stays in the base's dtype, at
    every ZeRO stage alike: DeepSpeed casts the model to the training precision under ZeRO-1/2 but not under ZeRO-3
    (its parameters come from `zero.Init`), where peft's fp32 adapter would compute in fp32, with fp32 copies of
    each adapted layer's input (for Llama-3-8B in bf16 at r 16 with dropout, 78,048 B per token and layer more)."""
    try:
        from peft import get_peft_model
    except ImportError as e:
        raise ValueError(import_failure(e)) from e

    if training_args.gradient_checkpointing:
        kwargs = dict(training_args.gradient_checkpointing_kwargs or {})
        kwargs.setdefault("use_reentrant", False)
        training_args.gradient_checkpointing_kwargs = kwargs
        if kwargs["use_reentrant"]:  # the reentrant checkpoint passes gradients only to inputs that require them
            model.enable_input_require_grads()
    try:  # under DeepSpeed the adapter computes in the base's dtype: the engine keeps its fp32 master weights
        return get_peft_model(model, config, autocast_adapter_dtype=not training_args.deepspeed)
    except ImportError as e:  # peft imports optional backends (torchao) as it adapts each layer
        raise ValueError(import_failure(e)) from e


def planned_adapter(model):
    """The adapter of a peft model as the planner counts it (`plan.types.Adapter`): its parameters (peft's count,
    ZeRO-3's partitioned ones whole), rank, the layers it adapts (the last name part of each module peft gave an
    adapter) and whether its dropout is on; None for another model."""
    if not hasattr(model, "peft_config"):
        return None
    config = model.peft_config["default"]
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    targets = tuple(n for n in LINEAR_LAYERS if n in adapted)  # the layers the planner knows (PlanError if none)
    return Adapter(model.get_nb_trainable_parameters()[0], config.r, targets, config.lora_dropout > 0)


def describe(model) -> str:
    """One line: the adapter's size against the model's."""
    trainable, total = model.get_nb_trainable_parameters()
    config = model.peft_config["default"]
    targets = config.target_modules if isinstance(config.target_modules, str) else ", ".join(sorted(config.target_modules))
    return (f"hf_zero3: LoRA r {config.r}, alpha {config.lora_alpha:g}, dropout {config.lora_dropout:g} on {targets}: "
            f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / max(total, 1):.2f}%); the base is "
            "frozen")
