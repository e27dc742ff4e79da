"""Read an existing ds_config back into a `ZeroSpec` (`hf-zero3 config new --like FILE`).

The result keeps the user's intent (stage, precision, offload, batch sizes, overlap, buckets) and drops
what does nothing or is wrong; every change is returned as a note so nothing is lost silently.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hf_zero3.config import batch
from hf_zero3.config.build import OFFLOADED_OPTIMIZER_BLOCK
from hf_zero3.config.check import KNOWN_TOP_LEVEL_KEYS, removed_keys
from hf_zero3.config.spec import AioSpec, Fp16Scaling, ZeroSpec

_ZERO_FIELDS = {
    "stage": "stage",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "sub_group_size": "sub_group_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_save",
}
_TOP_FIELDS = {
    "train_batch_size": "global_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "wall_clock_breakdown": "wall_clock_breakdown",
    "steps_per_print": "steps_per_print",
}
_REBUILT = {"zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "aio", "activation_checkpointing",
            *_TOP_FIELDS}
_OFFLOAD_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "ratio"}


def _never(value: Any) -> bool:
    """A steps_per_print that never comes round: inf (what accelerate writes to silence DeepSpeed) or null (DeepSpeed
    0.19's default)."""
    return value is None or (isinstance(value, float) and not math.isfinite(value) and value > 0)


def spec_from_ds_config(config: dict[str, Any], world_size: int | None = None) -> tuple[ZeroSpec, list[str]]:
    """The spec equivalent to `config`, and notes on what was changed, dropped or added.

    A block of the wrong JSON type (e.g. `"optimizer": "adam"`) is a ValueError naming it. Each step below reads
    one part of the config into `fields` and says what it changed in `notes`, in the order the notes are shown."""
    notes: list[str] = []
    fields: dict[str, Any] = {}
    removed, _ = removed_keys()
    _zero_fields(config, fields, notes)
    for key, field in _TOP_FIELDS.items():
        if key in config:
            fields[field] = config[key]
    if "steps_per_print" in config and _never(config["steps_per_print"]):  # DeepSpeed prints when steps % it == 0
        fields["steps_per_print"] = None
    fp16 = _precision_fields(config, fields, notes)
    offloaded = bool(fields.get("offload_optimizer"))
    _aio_fields(config, fields, notes)
    _optimizer_notes(config, offloaded, notes)
    if _block(config, "activation_checkpointing") or isinstance(config.get("activation_checkpointing"), dict):
        fields["activation_checkpointing"] = True
        notes.append("replaced the activation_checkpointing block (a no-op for HF models) by TrainingArguments "
                     "gradient_checkpointing: true")
        if asks_activation_offload(config):
            fields["activation_offload"] = True
            notes.append("kept cpu_checkpointing: true, which `hf-zero3 train` applies as activation offload "
                         "(hf_zero3/model/activation_offload.py)")
    if fp16.get("enabled") is True:
        notes.append("kept fp16 as asked; on A100/H100/H200 prefer bf16 (--precision bf16)")
    fields.update(_implied_batch(fields, world_size, notes))
    for key in sorted(set(config) & set(removed)):
        notes.append(f"dropped '{key}' (DeepSpeed refuses to start with it): {removed[key].strip()}")
    extra = {k: v for k, v in config.items() if k not in _REBUILT and k in KNOWN_TOP_LEVEL_KEYS}
    unknown = sorted(k for k in config if k not in _REBUILT and k not in KNOWN_TOP_LEVEL_KEYS and k not in removed)
    if unknown:
        notes.append(f"dropped unknown top-level keys (DeepSpeed ignores them): {unknown}")
    if extra:
        fields["extra"] = extra
    return ZeroSpec(**fields), notes


def _zero_fields(config: dict[str, Any], fields: dict[str, Any], notes: list[str]) -> None:
    """The zero_optimization block: its modelled keys, the deprecated gather key, keys DeepSpeed refuses, the
    offload blocks, and what is left (named in a note)."""
    _, removed_zero = removed_keys()
    zero = dict(_block(config, "zero_optimization"))
    for key, field in _ZERO_FIELDS.items():
        if key in zero:
            fields[field] = zero.pop(key)
    if "stage3_gather_fp16_weights_on_model_save" in zero:
        if "gather_16bit_weights_on_save" in fields:
            notes.append("dropped the deprecated stage3_gather_fp16_weights_on_model_save: its replacement "
                         "stage3_gather_16bit_weights_on_model_save is set")
        fields.setdefault("gather_16bit_weights_on_save", zero.pop("stage3_gather_fp16_weights_on_model_save"))
    if fields.get("stage", 0) == 3 and "gather_16bit_weights_on_save" not in fields:
        notes.append("added stage3_gather_16bit_weights_on_model_save: true (checkpoints hold loadable weights)")
    for key in sorted(set(zero) & set(removed_zero)):
        notes.append(f"dropped zero_optimization.{key} (DeepSpeed refuses to start with it): {removed_zero[key]}")
        zero.pop(key)
    for which in ("offload_optimizer", "offload_param"):
        block = _block(zero, which, f"zero_optimization.{which}")
        zero.pop(which, None)
        if block and block.get("device", "none") != "none":
            fields[which] = {k: v for k, v in block.items() if k in _OFFLOAD_KEYS}
            dropped = sorted(set(block) - _OFFLOAD_KEYS)
            if dropped:
                notes.append(f"not carried over from {which} (not modelled; re-add by hand): {dropped}")
            if which == "offload_optimizer":
                fields[which].pop("buffer_size", None)
                fields[which].pop("max_in_cpu", None)
            else:
                fields[which].pop("ratio", None)
    if zero:
        notes.append(f"not carried over from zero_optimization (not modelled; re-add by hand): {sorted(zero)}")


def _precision_fields(config: dict[str, Any], fields: dict[str, Any], notes: list[str]) -> dict:
    """The precision from the fp16 and bf16 blocks, fp16's loss scaling; returns the fp16 block."""
    fp16 = _block(config, "fp16")
    bf16 = _block(config, "bf16") or _block(config, "bfloat16")  # "bfloat16": DeepSpeed's old alias
    fields["precision"] = _precision_of_config(fp16.get("enabled"), bf16.get("enabled"))
    scaling = {k: v for k, v in fp16.items() if k in Fp16Scaling.model_fields}
    if fields["precision"] == "fp16" and scaling:
        fields["fp16"] = scaling
    for name, block, carried in (("fp16", fp16, fields.get("fp16", {})), ("bf16", bf16, {})):
        dropped = sorted(set(block) - {"enabled"} - set(carried))
        if dropped:
            notes.append(f"not carried over from {name} (not modelled; re-add by hand): {dropped}")
    return fp16


def _aio_fields(config: dict[str, Any], fields: dict[str, Any], notes: list[str]) -> None:
    """The aio block, kept only when something is offloaded to NVMe."""
    nvme = "nvme" in (fields.get(w, {}).get("device") for w in ("offload_optimizer", "offload_param"))
    aio = _block(config, "aio")
    if aio and not nvme:
        notes.append("dropped the aio block: it tunes NVMe offload only, and nothing is offloaded to NVMe")
    elif aio:
        fields["aio"] = {k: v for k, v in aio.items() if k in AioSpec.model_fields}
        dropped = sorted(set(aio) - set(AioSpec.model_fields))
        if dropped:
            notes.append(f"not carried over from aio (not modelled; re-add by hand): {dropped}"
                         + ("; DeepSpeed 0.19 ignores thread_count: use intra_op_parallelism" if "thread_count" in
                            dropped else ""))


def _optimizer_notes(config: dict[str, Any], offloaded: bool, notes: list[str]) -> None:
    """The optimizer block is rebuilt with offload (DeepSpeed's AdamW, 'auto' params) and dropped without: what that
    changes."""
    optimizer = _block(config, "optimizer")
    params = _block(optimizer, "params", "optimizer.params")
    bridged = {k: v for k, v in params.items() if k in OFFLOADED_OPTIMIZER_BLOCK["params"] and v != "auto"}
    others = sorted({*(f"params.{k}" for k in params if k not in OFFLOADED_OPTIMIZER_BLOCK["params"]),
                     *(k for k in optimizer if k not in ("type", "params"))})
    if bridged and offloaded:
        notes.append(f"optimizer params {bridged} are now 'auto': pass them as TrainingArguments (--learning_rate, "
                     "--adam_beta1/--adam_beta2, --adam_epsilon, --weight_decay)")
    if others and offloaded:
        notes.append(f"not carried over from optimizer (not modelled; re-add by hand): {others}")
    if "type" in optimizer and str(optimizer["type"]).lower() != "adamw" and offloaded:
        notes.append(f"replaced optimizer type {optimizer['type']!r} by 'AdamW' (DeepSpeedCPUAdam steps the offloaded "
                     "states); re-add the type by hand to keep it")
    if "optimizer" not in config and offloaded:
        notes.append("added an optimizer block (DeepSpeed AdamW, 'auto' params) so DeepSpeedCPUAdam runs")
    elif "optimizer" in config and not offloaded:
        notes.append(f"dropped the optimizer block ({json.dumps(optimizer)}): without offload the Trainer's --optim "
                     "and its TrainingArguments apply")


def asks_activation_offload(config: dict | None) -> bool:
    """Whether a ds_config asks for activation offload: `activation_checkpointing.cpu_checkpointing: true`."""
    block = (config or {}).get("activation_checkpointing")
    return isinstance(block, dict) and block.get("cpu_checkpointing") is True


def _block(parent: dict, key: str, where: str | None = None) -> dict:
    """`parent[key]` ({} when absent or null); a ValueError naming it when it is not a JSON object."""
    value = parent.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{where or key} must be a JSON object, not {json.dumps(value)}")
    return value or {}


def _precision_of_config(fp16: Any, bf16: Any) -> str:
    for name, value in (("fp16", fp16), ("bf16", bf16)):
        if value not in (True, False, None, "auto"):
            raise ValueError(f"{name}.enabled must be true, false or \"auto\", not {json.dumps(value)}")
    if "auto" in (fp16, bf16):
        return "auto"
    if bf16 is True:
        return "bf16"
    if fp16 is True:
        return "fp16"
    return "fp32"


def _implied_batch(fields: dict, world_size: int | None, notes: list[str]) -> dict[str, Any]:
    total, accum = fields.get("global_batch_size"), fields.get("gradient_accumulation_steps")
    if world_size and isinstance(total, int) and isinstance(accum, int) and "micro_batch_size" not in fields:
        if (micro := batch.accumulation(total, accum, world_size)) is not None:  # micro = total / accum / world
            notes.append(f"made the implied micro batch explicit: {micro} ({total} / {accum} / {world_size})")
            return {"micro_batch_size": micro}
    return {}
