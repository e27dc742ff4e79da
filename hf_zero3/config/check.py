"""Validate any ds_config (ours or a user's) and report every finding at once, each naming the fix.

DeepSpeed itself ignores unknown top-level keys and drops `"auto"` values it does not understand,
so a typo or a copied template can silently train with defaults. We check the whole tree: our own
table for top-level keys and small blocks, DeepSpeed's own pydantic models for the rest.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from hf_zero3.config import batch, trainer_findings, zero_findings
from hf_zero3.config.build import BRIDGE_FILLED_KEYS
from hf_zero3.config.findings import Finding, lookup

KNOWN_TOP_LEVEL_KEYS = frozenset(
    """
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler
    communication_data_type seq_parallel_communication_data_type prescale_gradients gradient_predivide_factor
    gradient_allreduce_op fp16 bf16 bfloat16 torch_autocast gradient_clipping
    zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer aio activation_checkpointing
    steps_per_print wall_clock_breakdown memory_breakdown dump_state flops_profiler tensorboard csv_monitor
    wandb comet comms_logger autotuning data_efficiency checkpoint data_types pipeline disable_allgather
    dataloader_drop_last timers compile hybrid_engine weight_quantization tensor_parallel sequence_parallel_size
    expert_parallel use_data_before_expert_parallelism log_level disable_python_gc managed_gradient_accumulation
    vocabulary_size datastates_ckpt
    """.split()
)
"""Top-level keys DeepSpeed 0.19 reads (runtime/config.py, constants.py and the feature configs). The blocks it
removed (amp, nebula, elasticity, ...) are not here: it refuses to start with them (`removed_keys`)."""

SMALL_BLOCK_KEYS = {
    "optimizer": {"type", "params", "legacy_fusion"},
    "scheduler": {"type", "params"},
    "aio": {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
            "overlap_events", "use_gds"},  # thread_count: accepted, ignored (IGNORED_KEYS)
    "activation_checkpointing": {"partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                                 "number_checkpoints", "synchronize_checkpoint_boundary", "profile"},
    "flops_profiler": {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
                       "output_file"},
    "checkpoint": {"tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer",
                   "checkpoint_serialization"},
    "data_types": {"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"},
    "timers": {"throughput"},
}

IGNORED_KEYS = {
    "aio.thread_count": "DeepSpeed 0.19 ignores it (swap_tensor/aio_config.py reads block_size, queue_depth, "
                        "intra_op_parallelism, single_submit, overlap_events and use_gds): set intra_op_parallelism "
                        "for parallel I/O threads and remove thread_count",
}
"""Keys DeepSpeed accepts but does not read: the setting does nothing."""

ADAM_EXTRA_PARAMS = frozenset({"adam_w_mode", "torch_adam", "fp32_optimizer_states"})
"""Adam/AdamW params DeepSpeed's engine pops before building the optimizer (engine.py _configure_basic_optimizer)."""

POSITIVE_KEYS = frozenset(
    {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
        "zero_optimization.sub_group_size", "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_optimizer.buffer_count", "aio.block_size", "aio.queue_depth",
        "aio.intra_op_parallelism",
    }
)
NON_NEGATIVE_KEYS = frozenset(
    {
        "gradient_clipping", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.offload_param.max_in_cpu",
    }
)

def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ds_config JSON file; a clear error for a missing or malformed file."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"ds_config {path} is a folder: pass the path of its DeepSpeed JSON file")
    if not path.is_file():
        raise FileNotFoundError(f"ds_config {path} not found: pass the path of a DeepSpeed JSON config")
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"ds_config {path} cannot be read ({e.strerror}): fix its permissions or copy it "
                         "somewhere this user can read") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"ds_config {path} is not text (byte {e.start} is not UTF-8): pass a JSON file") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}. "
                         "Fix the JSON there (`python -m json.tool FILE` shows it)") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object at the top level, not {type(config).__name__}")
    return config


def check_ds_config(
    config: dict[str, Any],
    *,
    world_size: int | None = None,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    device: Literal["cpu", "cuda"] | None = None,
    training_args: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """Every finding about `config`; `device=None` skips device-specific checks.

    `training_args` (TrainingArguments values by name, defaults included) are what the HF bridge fills `"auto"`
    from and matches explicit values against: given, they also supply the micro batch and accumulation, and
    a mismatch is reported here instead of by the Trainer after the model has loaded.
    """
    names = ("--micro-batch", "--grad-accum")
    if training_args is not None:
        micro_batch = training_args["per_device_train_batch_size"]
        grad_accum = training_args["gradient_accumulation_steps"]
        names = ("per_device_train_batch_size", "gradient_accumulation_steps")
    findings: list[Finding] = []
    findings += _sizes(config)
    findings += _unknown_and_invalid(config)
    findings += _autos(config)
    for name, value in zip(names, (micro_batch, grad_accum)):
        if _int_or_none(value) is not None and value <= 0:
            findings.append(Finding("error", name, f"must be >= 1 (got {value})"))
    findings += _batch(config, world_size, micro_batch, grad_accum, names)
    findings += trainer_findings.precision(config, device, training_args)
    findings += trainer_findings.bridge_matches(config, training_args or {})
    findings += trainer_findings.warmup(config, training_args)
    findings += zero_findings.zero(config)
    findings += zero_findings.super_offload(config, device)
    findings += _optimizer(config.get("optimizer"))  # after the zero block's: a partial-offload problem is named first
    findings += zero_findings.persistence(config, world_size)
    # One finding per key and level: our own message wins over DeepSpeed's generic one.
    seen: set[tuple[str, str]] = set()
    unique = []
    for f in findings:
        if (f.key, f.level) not in seen:
            seen.add((f.key, f.level))
            unique.append(f)
    return unique


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


def _leaves(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def _did_you_mean(key: str, candidates) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _block_models() -> dict[str, type[BaseModel]]:
    """The blocks DeepSpeed reads through its own strict pydantic models (unknown keys are errors there)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    return {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
            "tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig, "comet": CometConfig,
            "comms_logger": CommsLoggerConfig, "compile": CompileConfig, "hybrid_engine": HybridEngineConfig,
            "tensor_parallel": TPTrainingConfig, "timers.throughput": DeepSpeedThroughputTimerConfig}


def removed_keys() -> tuple[dict[str, str], dict[str, str]]:
    """DeepSpeed's own tables of the top-level and zero_optimization keys it removed and refuses at start-up,
    each with its reason (runtime/config.py, 0.19+; empty where the installed DeepSpeed has none)."""
    from deepspeed.runtime import config as ds_config

    return (getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}),
            getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}))


def _unknown_and_invalid(config: dict) -> list[Finding]:
    findings = []
    removed, removed_zero = removed_keys()
    zero = config.get("zero_optimization")
    for key, why in [*((k, removed[k]) for k in config if k in removed),
                     *((f"zero_optimization.{k}", removed_zero[k]) for k in (zero if isinstance(zero, dict) else {})
                       if k in removed_zero)]:
        findings.append(Finding("error", key, f"removed from DeepSpeed, which refuses to start with it: "
                                              f"{why.strip()} Remove '{key.split('.')[-1]}' from the config."))
    for key in config:
        if key in removed:
            continue
        if key not in KNOWN_TOP_LEVEL_KEYS:
            findings.append(Finding("error", key, "unknown top-level key (DeepSpeed ignores it silently)"
                                    f"{_did_you_mean(key, KNOWN_TOP_LEVEL_KEYS)} Remove or rename it."))
    for block, allowed in SMALL_BLOCK_KEYS.items():
        value = config.get(block)
        if value is not None and not isinstance(value, dict):
            fix = (f"write it as {json.dumps({'type': value, 'params': {}})}" if block in ("optimizer", "scheduler")
                   else f"write it as an object of {block} keys")
            findings.append(Finding("error", block, f"must be a JSON object, not {json.dumps(value)}: {fix}, "
                                                    "or remove it"))
        if isinstance(value, dict):
            for key in value:
                if key not in allowed:
                    findings.append(Finding("error", f"{block}.{key}", f"unknown key in '{block}'"
                                            f"{_did_you_mean(key, allowed)} Allowed: {', '.join(sorted(allowed))}."))
    findings += [Finding("warning", key, why) for key, why in IGNORED_KEYS.items() if lookup(config, key) is not None]
    findings += _scheduler_params(config.get("scheduler"))
    for block, model in _block_models().items():
        value = lookup(config, block)
        if value is None:
            continue
        if not isinstance(value, dict):
            findings.append(Finding("error", block, f"must be a JSON object, not {value!r}"))
            continue
        findings += _validate_with(model, block, value)
    return findings


def _scheduler_params(scheduler: Any) -> list[Finding]:
    """DeepSpeed passes scheduler.params to the scheduler as keyword arguments: a misspelt one stops the run."""
    import inspect

    import torch
    from deepspeed.runtime import lr_schedules

    if not isinstance(scheduler, dict) or "type" not in scheduler:
        return []
    kind = scheduler["type"]
    cls = None
    if isinstance(kind, str):
        cls = getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind, None)
    if cls is None:
        return [Finding("error", "scheduler.type", f"unknown scheduler {kind!r}; use one of "
                                                   f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)} (or remove the "
                                                   "block: the Trainer's --lr_scheduler_type applies)")]
    params = scheduler.get("params")
    allowed = set(inspect.signature(cls).parameters) - {"optimizer", "self"}
    return [Finding("error", f"scheduler.params.{key}", f"unknown parameter of {kind}{_did_you_mean(key, allowed)} "
                                                        f"Allowed: {', '.join(sorted(allowed))}.")
            for key in (params if isinstance(params, dict) else {}) if key not in allowed]


def _optimizer(optimizer: Any) -> list[Finding]:
    """The optimizer type DeepSpeed builds and the params it passes to it as keyword arguments: a misspelt one
    stops the run (engine.py `_configure_basic_optimizer`)."""
    import inspect

    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    if not isinstance(optimizer, dict):
        return []  # absent, or reported as not a JSON object
    kind = optimizer.get("type")
    if kind is None:
        return [Finding("error", "optimizer.type", "missing: DeepSpeed then builds no optimizer from this block. Add "
                                                   "\"type\": \"AdamW\" (or remove the block: the Trainer's --optim "
                                                   "applies)")]
    # The classes DeepSpeed may build for each of its names (offloaded or not, torch_adam or not).
    classes = {"adam": (FusedAdam, DeepSpeedCPUAdam, torch.optim.Adam),
               "adamw": (FusedAdam, DeepSpeedCPUAdam, torch.optim.AdamW), "lamb": (FusedLamb,),
               "lion": (FusedLion, DeepSpeedCPULion), "adagrad": (DeepSpeedCPUAdagrad, torch.optim.Adagrad)}
    torch_class = getattr(torch.optim, kind, None) if isinstance(kind, str) else None
    if isinstance(kind, str) and kind.lower() in DEEPSPEED_OPTIMIZERS:
        cls = classes.get(kind.lower())  # the mu* and muon optimizers: their params are not checked
    elif isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer):
        cls = (torch_class,)
    else:
        return [Finding("error", "optimizer.type",
                        f"unknown optimizer {kind!r}{_did_you_mean(str(kind).lower(), DEEPSPEED_OPTIMIZERS)} Use one "
                        f"of DeepSpeed's {', '.join(DEEPSPEED_OPTIMIZERS)} (any case) or a torch.optim class name "
                        "such as 'SGD' (or remove the block: the Trainer's --optim applies)")]
    params = optimizer.get("params")
    if cls is None or not isinstance(params, dict):
        return []
    allowed = set().union(*(inspect.signature(c).parameters for c in cls)) - {"params", "model_params", "adamw_mode",
                                                                              "max_grad_norm"}
    if kind.lower() in ("adam", "adamw"):
        allowed |= ADAM_EXTRA_PARAMS
    return [Finding("error", f"optimizer.params.{key}",
                    "DeepSpeed refuses it: set the top-level gradient_clipping instead" if key == "max_grad_norm" else
                    f"unknown parameter of {kind}{_did_you_mean(key, allowed)} Allowed: {', '.join(sorted(allowed))}.")
            for key in params if key not in allowed]


def _validate_with(model: type[BaseModel], block: str, value: dict) -> list[Finding]:
    """Run a DeepSpeed pydantic model over a block; unfilled "auto" values are reported elsewhere."""
    stage = value.get("stage") if block == "zero_optimization" else None
    data = {k: v for k, v in value.items() if not (block == "zero_optimization" and k == "stage")}
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        findings = [Finding("error", f"{block}.stage", f"ZeRO stage must be 0, 1, 2 or 3 (got {stage!r}): "
                                                       "use 3 to partition params, grads and optimizer states")]
    else:
        findings = []
        if stage is not None:
            data["stage"] = stage
    try:
        model(**data)
    except AssertionError as e:  # DeepSpeed's deprecated-field check: an old key given together with its replacement
        old = str(e).split("'")[1] if "'" in str(e) else ""
        findings.append(Finding("error", f"{block}.{old}" if old else block,
                                f"{e} (DeepSpeed asserts at start-up): remove the deprecated '{old}'"))
    except ValidationError as e:
        names = _field_names(model)
        for err in e.errors():
            key = ".".join([block, *map(str, err["loc"])])
            if err["type"] == "extra_forbidden":
                leaf = str(err["loc"][-1])
                findings.append(Finding("error", key, f"unknown key (DeepSpeed rejects it at start-up)"
                                                      f"{_did_you_mean(leaf, names)} Remove or rename it."))
            else:
                findings.append(Finding("error", key, f"invalid value {err.get('input')!r}: {err['msg']}"))
    return findings


def _field_names(model: type[BaseModel]) -> set[str]:
    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(field.alias or name)
        annotation = getattr(field.annotation, "__args__", (field.annotation,))
        for sub in annotation:
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                names |= _field_names(sub)
    return names


def _sizes(config: dict) -> list[Finding]:
    findings = []
    for key, value in _leaves(config):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key in POSITIVE_KEYS and value <= 0:
            findings.append(Finding("error", key, f"must be a positive number (got {value}): "
                                                  "set a value > 0 or 'auto' where the Trainer fills it"))
        elif key in NON_NEGATIVE_KEYS and value < 0:
            findings.append(Finding("error", key, f"must be >= 0 (got {value})"))
    return findings


def _autos(config: dict) -> list[Finding]:
    findings = []
    for key, value in _leaves(config):
        if value == "auto" and key not in BRIDGE_FILLED_KEYS:
            findings.append(Finding("error", key, "'auto' here is filled by nobody: DeepSpeed drops it silently "
                                                  "and uses its own default. Write an explicit value. ('auto' is "
                                                  "filled by the HF Trainer only for: "
                                                  f"{', '.join(sorted(BRIDGE_FILLED_KEYS))})"))
    return findings


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _batch(config: dict, world: int | None, micro_arg: int | None, accum_arg: int | None,
           names: tuple[str, str]) -> list[Finding]:
    findings = []
    total = _int_or_none(config.get("train_batch_size"))
    micro = _int_or_none(config.get("train_micro_batch_size_per_gpu"))
    accum = _int_or_none(config.get("gradient_accumulation_steps"))
    for key, in_config, given, flag in (("train_micro_batch_size_per_gpu", micro, micro_arg, names[0]),
                                        ("gradient_accumulation_steps", accum, accum_arg, names[1])):
        if in_config is not None and given is not None and in_config != given:
            findings.append(Finding("error", key, f"the config says {in_config} but {flag} is {given}: "
                                                  f"make them equal or set {key} to 'auto'"))
    micro = micro if micro is not None else micro_arg
    accum = accum if accum is not None else accum_arg
    if any(v is not None and v <= 0 for v in (total, micro, accum, world)):
        return findings  # reported by _sizes / argument parsing
    if total is not None and micro is not None and accum is not None:
        implied_world = batch.world_size_of(total, micro, accum)
        if world is not None and total != (expected := batch.global_batch(micro, accum, world)):
            findings.append(Finding("error", "train_batch_size",
                                    f"{total} != micro batch {micro} x accumulation {accum} x world size {world} "
                                    f"= {expected}: set train_batch_size to {expected} or to 'auto'"))
        elif world is None and implied_world is None:
            findings.append(Finding("error", "train_batch_size",
                                    f"{total} is not a multiple of micro batch {micro} x accumulation {accum}: "
                                    "no world size fits; set it to 'auto'"))
        elif world is None:
            findings.append(Finding("info", "train_batch_size",
                                    f"implies world size {implied_world} (= {total} / {micro} / {accum})"))
    elif world is not None and total is not None:
        if micro is not None:
            known, name, other, other_name = micro, "micro batch", "gradient_accumulation_steps", "accumulation"
        else:
            known, name, other, other_name = accum, "accumulation", "train_micro_batch_size_per_gpu", "micro batch"
        implied = batch.accumulation(total, known, world) if known is not None else None
        if known is None and batch.per_rank(total, world) is None:
            findings.append(Finding("error", "train_batch_size",
                                    f"{total} is not divisible by world size {world} (DeepSpeed asserts train_batch_size "
                                    "= micro batch x accumulation x world size): set it to a multiple of "
                                    f"{world}, or to 'auto'"))
        elif known is None:
            findings.append(Finding("info", "train_batch_size",
                                    f"DeepSpeed will use accumulation 1 and micro batch {total} / {world}"))
        elif implied is None:
            findings.append(Finding("error", "train_batch_size",
                                    f"{total} is not divisible by {name} {known} x world size {world}: "
                                    f"change train_batch_size or {other}"))
        else:
            findings.append(Finding("info", other, f"{other_name} = {implied} is implied ({total} / {known} / {world}):"
                                                   f" set {other} to {implied} (or pass the same TrainingArguments)"))
    elif total is not None and world is None and (micro is None or accum is None):
        findings.append(Finding("info", "train_batch_size",
                                "the micro batch / accumulation it implies depend on the world size: "
                                "pass --world-size to check the batch math"))
    return findings


