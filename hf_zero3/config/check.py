"""Validate any ds_config (ours or a user's) and report every finding at once, each naming the fix.

DeepSpeed itself ignores unknown top-level keys and drops `"auto"` values it does not understand,
so a typo or a copied template can silently train with defaults. We check the whole tree: our own
table for top-level keys and small blocks, DeepSpeed's own pydantic models for the rest.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from hf_zero3.config import batch
from hf_zero3.config.build import BRIDGE_FILLED_KEYS, OFFLOADED_OPTIMIZER_BLOCK

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

Level = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One problem or note about a config: where (dotted key), what, and the fix."""

    level: Level
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key else ""
        return f"{self.level.upper():7} {where}{self.message}"


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
    findings += _check_precision(config, device, training_args)
    findings += _bridge_matches(config, training_args or {})
    findings += _warmup(config, training_args)
    findings += _zero(config)
    findings += _super_offload(config, device)
    findings += _optimizer(config.get("optimizer"))  # after _zero: a partial-offload problem is named first
    findings += _persistence(config, world_size)
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


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


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
    findings += [Finding("warning", key, why) for key, why in IGNORED_KEYS.items() if _get(config, key) is not None]
    findings += _scheduler_params(config.get("scheduler"))
    for block, model in _block_models().items():
        value = _get(config, block)
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


def _enabled(config: dict, block: str) -> bool:
    return _get(config, f"{block}.enabled") is True


def _check_precision(config: dict, device: str | None, training_args: Mapping[str, Any] | None) -> list[Finding]:
    findings = []
    if training_args is not None:
        # What DeepSpeed will run with once the bridge has filled "auto" from TrainingArguments.
        on = {block: _get(config, f"{block}.enabled") is True or (_get(config, f"{block}.enabled") == "auto"
                                                                    and bool(training_args.get(block)))
              for block in ("fp16", "bf16")}
        if on["fp16"] and on["bf16"] and not (_enabled(config, "fp16") and _enabled(config, "bf16")):
            findings.append(Finding("error", "fp16.enabled",
                                    "fp16 and bf16 would both be on (the ds_config's and TrainingArguments' fp16/bf16 "
                                    "together): keep one, e.g. set both blocks' enabled to 'auto' and pass only "
                                    "--bf16 true (Ampere/Hopper) or only --fp16 true (V100/T4)"))
    if "bfloat16" in config:
        if "bf16" in config:
            findings.append(Finding("error", "bfloat16", "both 'bf16' and its old alias 'bfloat16' are set: DeepSpeed "
                                                         "reads only 'bf16'. Remove the 'bfloat16' block"))
        else:
            findings.append(Finding("warning", "bfloat16", "old alias of 'bf16': the HF Trainer adds "
                                                           "bf16.enabled=false when --bf16 is off, which DeepSpeed "
                                                           "reads first, so the run trains in fp32. Rename it 'bf16'"))
    if _enabled(config, "fp16") and (_enabled(config, "bf16") or _enabled(config, "bfloat16")):
        findings.append(Finding("error", "fp16.enabled", "fp16 and bf16 are both enabled: keep one "
                                                         "(bf16 on Ampere/Hopper, fp16 on V100/T4)"))
    if _enabled(config, "fp16"):
        if device == "cpu":
            findings.append(Finding("error", "fp16.enabled", "fp16 is not supported on CPU: set fp16.enabled "
                                                             "false (fp32) or use bf16"))
        findings.append(Finding("warning", "fp16.enabled",
                                "on Ampere/Hopper GPUs (A100, H100, H200) prefer bf16: same speed, no loss "
                                "scaling and no skipped overflow steps. Set bf16.enabled true and drop fp16 "
                                "(keep fp16 only for GPUs without bf16: V100, T4)"))
    return findings


BRIDGE_MATCHED = {
    "gradient_clipping": ("max_grad_norm", lambda a: a["max_grad_norm"]),
    "optimizer.params.lr": ("learning_rate", lambda a: a["learning_rate"]),
    "optimizer.params.betas": ("adam_beta1+adam_beta2", lambda a: [a["adam_beta1"], a["adam_beta2"]]),
    "optimizer.params.eps": ("adam_epsilon", lambda a: a["adam_epsilon"]),
    "optimizer.params.weight_decay": ("weight_decay", lambda a: a["weight_decay"]),
    "scheduler.params.warmup_max_lr": ("learning_rate", lambda a: a["learning_rate"]),
    "fp16.enabled": ("fp16", lambda a: bool(a["fp16"] or a["fp16_full_eval"])),
    "bf16.enabled": ("bf16", lambda a: bool(a["bf16"] or a["bf16_full_eval"])),
}
"""ds_config key -> the TrainingArguments value HfTrainerDeepSpeedConfig.trainer_config_process matches it with
(transformers 5.x; the batch keys are checked in `_batch`)."""


def _bridge_matches(config: dict, training_args: Mapping[str, Any]) -> list[Finding]:
    """An explicit value that differs from TrainingArguments: the bridge stops the run on it, after the model loaded."""
    findings = []
    for key, (name, value_of) in BRIDGE_MATCHED.items() if training_args else ():
        ours, theirs = _get(config, key), value_of(training_args)
        if ours is not None and ours != "auto" and ours != theirs:
            findings.append(Finding("error", key, f"the config says {json.dumps(ours, default=str)} but TrainingArguments "
                                                  f"{name} is {json.dumps(theirs, default=str)}: set {key} to 'auto' (the Trainer fills "
                                                  f"it) or make them equal"))
    return findings


WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""DeepSpeed's schedulers that take `warmup_num_steps` (DeepSpeed 0.19.6 and later refuse it below 1; before, WarmupLR
and WarmupDecayLR raised it to 2)."""
DEEPSPEED_REFUSES_NO_WARMUP = (0, 19, 6)
TRANSFORMERS_FILLS_AT_LEAST_ONE = (5, 18)
"""From this transformers release the bridge fills `"auto"` warmup_num_steps with max(1, the run's warmup steps);
before it, with the warmup steps as they are (0 by default)."""


def _version(package: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version(package).split("+")[0].split(".")[:3] if part.isdigit())


def _warmup(config: dict, training_args: Mapping[str, Any] | None) -> list[Finding]:
    """A DeepSpeed warmup scheduler with no warmup: DeepSpeed refuses it when the engine starts, after the model
    loaded (`warmup_num_steps must be a positive integer, got 0`), or the run warms up where none was asked."""
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict) or scheduler.get("type") not in WARMUP_SCHEDULERS:
        return []
    params = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
    value = params.get("warmup_num_steps", 1000)  # DeepSpeed's default
    if value == "auto" and training_args is not None:
        warmup = training_args.get("warmup_steps") or training_args.get("warmup_ratio") or 0
        return warmup_findings(scheduler["type"], "auto", float(warmup), _version("transformers"),
                               _version("deepspeed"))
    return warmup_findings(scheduler["type"], value, None, _version("transformers"), _version("deepspeed"))


def warmup_findings(kind: str, value: Any, warmup_steps: float | None, transformers: tuple[int, ...],
                    deepspeed: tuple[int, ...]) -> list[Finding]:
    """What DeepSpeed's `kind` scheduler does with `warmup_num_steps` `value` ("auto": filled from `warmup_steps`, the
    TrainingArguments'), under these transformers and DeepSpeed versions."""
    key = "scheduler.params.warmup_num_steps"
    fix = (f"set warmup_steps to 1 or more (the Trainer fills {key} from it), or remove the scheduler block: the "
           "Trainer's own schedule then applies (lr_scheduler_type, warmup_steps), where no warmup is allowed")
    if value == "auto":
        if warmup_steps is None or warmup_steps > 0:
            return []
        filled = 1 if transformers >= TRANSFORMERS_FILLS_AT_LEAST_ONE else 0
    elif isinstance(value, int) and not isinstance(value, bool) and value < 1:
        filled, fix = value, f"set {key} to 1 or more, or remove the scheduler block (the Trainer's schedule applies)"
    else:
        return []
    if filled < 1 and deepspeed >= DEEPSPEED_REFUSES_NO_WARMUP:
        source = "warmup_steps is 0 and this transformers fills it as is" if value == "auto" else "it is"
        return [Finding("error", key, f"{kind} needs at least 1 warmup step and DeepSpeed "
                                      f"{'.'.join(map(str, deepspeed))} stops the run on {filled} once the model has "
                                      f"loaded ({source}): {fix}")]
    given = "warmup_steps 0, which this transformers fills as 1" if value == "auto" and filled else f"{filled}"
    return [Finding("warning", key, f"{kind} warms up over at least 2 steps whatever it is given ({given}): the first "
                                    "step trains at the warmup's lowest learning rate. For no warmup remove the "
                                    "scheduler block (the Trainer's lr_scheduler_type and warmup_steps apply)")]


def _super_offload(config: dict, device: str | None) -> list[Finding]:
    """`offload_optimizer.super_offload` (DeepSpeed's CPU Adam step overlapped with backward): what DeepSpeed 0.19
    asserts once the model has loaded, or ignores."""
    key = "zero_optimization.offload_optimizer.super_offload"
    if _get(config, key) is not True:
        return []
    stage = _get(config, "zero_optimization.stage", 0)
    opt_device = _get(config, "zero_optimization.offload_optimizer.device")
    if stage != 3 or opt_device != "cpu":
        return [Finding("error", key, f"SuperOffload needs ZeRO stage 3 with offload_optimizer.device 'cpu' (stage is "
                                      f"{stage}, device {opt_device!r}): set both, or remove super_offload")]
    if device == "cpu":
        return [Finding("error", key, "SuperOffload runs on NVIDIA GPUs only (DeepSpeed asserts a CUDA accelerator "
                                      "after the model has loaded): remove super_offload for a run on CPU")]
    return []


def _zero(config: dict) -> list[Finding]:
    findings = []
    stage = _get(config, "zero_optimization.stage", 0)
    param_device = _get(config, "zero_optimization.offload_param.device", "none")
    opt_device = _get(config, "zero_optimization.offload_optimizer.device", "none")
    if param_device not in ("none", None) and stage in (0, 1, 2):
        findings.append(Finding("error", "zero_optimization.offload_param",
                                f"parameter offload needs ZeRO stage 3 (stage is {stage}): set "
                                "zero_optimization.stage to 3 or remove offload_param"))
    if opt_device not in ("none", None) and "optimizer" not in config and \
            config.get("zero_force_ds_cpu_optimizer", True) is not False:
        findings.append(Finding("error", "optimizer",
                                "the optimizer is offloaded but there is no optimizer block: the Trainer then "
                                "passes torch AdamW, which DeepSpeed refuses with ZeRO-Offload (or runs slowly "
                                "on CPU). Add " + json.dumps({"optimizer": OFFLOADED_OPTIMIZER_BLOCK})
                                + " (hf-zero3 config new does)"))
    if opt_device == "nvme" and stage in (1, 2):
        findings.append(Finding("error", "zero_optimization.offload_optimizer.device",
                                f"'nvme' needs ZeRO stage 3 (stage is {stage}): stages 1 and 2 offload to host RAM "
                                "whatever the device and ignore nvme_path (DeepSpeed's stage_1_and_2.py). Set "
                                "zero_optimization.stage to 3, or device to 'cpu'"))
    findings += _partial_offload(config, stage, opt_device)
    for which, device in (("offload_param", param_device), ("offload_optimizer", opt_device)):
        if device == "nvme":
            findings += _nvme_path(f"zero_optimization.{which}.nvme_path",
                                   _get(config, f"zero_optimization.{which}.nvme_path"))
    findings += _activation_checkpointing(config.get("activation_checkpointing"))
    gather = _get(config, "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                  _get(config, "zero_optimization.stage3_gather_fp16_weights_on_model_save", None))
    if stage == 3 and gather is not True:  # left out (DeepSpeed's default: off) is a warning; set false, a choice
        level = "info" if gather is False else "warning"
        findings.append(Finding(level, "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                                "is off: Trainer.save_model() then writes no usable weights, only ZeRO shards; "
                                "`hf-zero3 export <checkpoint-N or finished output_dir> OUT` writes the Hugging Face "
                                "folder. Set it to true unless rank 0's host RAM cannot hold a 16-bit copy of the "
                                "whole model at each save (`hf-zero3 plan` counts it)"))
    return findings


WHOLE_MODEL_THRESHOLD = 10**10
"""A persistence threshold at least this large keeps every tensor of any model we plan for whole (the largest, a
256k x 32k embedding, has 8.4e9 elements)."""


def _persistence(config: dict, world_size: int | None) -> list[Finding]:
    """The one-GPU setting `stage3_param_persistence_threshold: EVERY_PARAMETER` taken to more GPUs keeps the whole
    16-bit model on each of them, beside its partitions."""
    threshold = _get(config, "zero_optimization.stage3_param_persistence_threshold")
    if (_get(config, "zero_optimization.stage", 0) != 3 or not world_size or world_size < 2
            or not isinstance(threshold, (int, float)) or isinstance(threshold, bool)
            or threshold < WHOLE_MODEL_THRESHOLD):
        return []
    return [Finding("warning", "zero_optimization.stage3_param_persistence_threshold",
                    f"{threshold} keeps every parameter whole on each of the {world_size} ranks, beside its "
                    "partition: the whole 16-bit model on every GPU. That is the planner's choice for one GPU, "
                    "where it costs nothing; on more, set \"auto\" (or a value below the layer matrices, which "
                    "`hf-zero3 plan` counts)")]


def _activation_checkpointing(block: Any) -> list[Finding]:
    """DeepSpeed's block configures only deepspeed.checkpointing.checkpoint, which HF models never call; of its
    keys, cpu_checkpointing is carried out by `hf-zero3 train` (activation offload), the rest do nothing."""
    if not isinstance(block, dict):
        return []
    findings = []
    if block.get("cpu_checkpointing") is True:
        findings.append(Finding("info", "activation_checkpointing.cpu_checkpointing",
                                "applied by `hf-zero3 train` as activation offload (hf_zero3/run/activation_offload.py"
                                "): the activations the decoder saves for backward, with gradient_checkpointing the "
                                "checkpointed layer inputs, live in pinned host memory. DeepSpeed alone does not "
                                "apply it to HF models: with a plain `--deepspeed` script it does nothing unless the "
                                "script calls hf_zero3.run.activation_offload.enable(model) before its Trainer"))
    inert = sorted(k for k, v in block.items() if k != "cpu_checkpointing" and v not in (False, None))
    if inert or not findings:
        what = ", ".join(inert) if inert else "this block"
        findings.append(Finding("warning", "activation_checkpointing",
                                f"{what}: only configures deepspeed.checkpointing.checkpoint, which HF models never "
                                "call: it does nothing. Remove it and set TrainingArguments gradient_checkpointing: "
                                "true with gradient_checkpointing_kwargs: {use_reentrant: false}"))
    return findings


def _partial_offload(config: dict, stage: Any, opt_device: Any) -> list[Finding]:
    """`offload_optimizer.ratio` (partial offload): what DeepSpeed 0.19 asserts or silently ignores."""
    key, ratio = "zero_optimization.offload_optimizer.ratio", _get(config, "zero_optimization.offload_optimizer.ratio")
    if ratio is None:
        return []
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        return [Finding("error", key, f"must be a number in (0, 1] (got {ratio!r}): the fraction of the optimizer "
                                      "states stepped on the CPU; 1.0 offloads them all")]
    if ratio == 1:
        return []
    found = []  # one finding per key (check_ds_config keeps the first of a key), so the problems are joined
    if stage != 3:
        found.append(f"partial offload needs ZeRO stage 3 (stage is {stage}; DeepSpeed asserts): set "
                     "zero_optimization.stage to 3 or remove ratio")
    if opt_device != "cpu":
        found.append(f'partial offload needs offload_optimizer.device "cpu" (is {opt_device!r}): the GPU part is '
                     'stepped by torch AdamW, the rest by DeepSpeedCPUAdam; set device "cpu" or remove ratio')
    opt_type = str(_get(config, "optimizer.type", "")).lower()
    if opt_device == "cpu" and (opt_type not in ("adam", "adamw") or config.get("zero_force_ds_cpu_optimizer") is False):
        found.append("partial offload needs DeepSpeedCPUAdam (DeepSpeed asserts 'Hybrid Optimizer Only Supports "
                     'DeepSpeedCPUAdam\'): use the optimizer block {"type": "AdamW", "params": {...}} (hf-zero3 '
                     "config new writes it)")
    return [Finding("error", key, "; ".join(found))] if found else []


def _nvme_path(key: str, path: Any) -> list[Finding]:
    if not path:
        return [Finding("error", key, "NVMe offload needs nvme_path: a directory on a fast local NVMe mount")]
    if not os.path.isdir(path):
        return [Finding("error", key, f"{path} does not exist on this machine: create it "
                                      f"(mkdir -p {path}) on every node or point nvme_path at a mounted NVMe dir")]
    if not _writable(path):
        return [Finding("error", key, f"{path} is not writable by this user: fix its permissions "
                                      f"(chown/chmod) or pick another directory")]
    return []


def _writable(directory: str) -> bool:
    """Try a real write: os.access says yes to root even on read-only or pseudo file systems."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False
