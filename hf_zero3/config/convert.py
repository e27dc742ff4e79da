"""Read an existing ds_config back into a `ZeroSpec` (`hf-zero3 config new --like FILE`).

The result keeps the user's intent (stage, precision, offload, batch sizes, overlap, buckets) and drops
what does nothing or is wrong; every change is returned as a note so nothing is lost silently.
"""

from __future__ import annotations

from typing import Any

from hf_zero3.config.check import KNOWN_TOP_LEVEL_KEYS
from hf_zero3.config.spec import Fp16Scaling, ZeroSpec

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


def spec_from_ds_config(config: dict[str, Any], world_size: int | None = None) -> tuple[ZeroSpec, list[str]]:
    """The spec equivalent to `config`, and notes on what was changed, dropped or added."""
    notes: list[str] = []
    fields: dict[str, Any] = {}
    zero = dict(config.get("zero_optimization") or {})
    for key, field in _ZERO_FIELDS.items():
        if key in zero:
            fields[field] = zero.pop(key)
    if "stage3_gather_fp16_weights_on_model_save" in zero:
        fields["gather_16bit_weights_on_save"] = zero.pop("stage3_gather_fp16_weights_on_model_save")
    if fields.get("stage", 0) == 3 and "gather_16bit_weights_on_save" not in fields:
        notes.append("added stage3_gather_16bit_weights_on_model_save: true (checkpoints hold loadable weights)")
    for which in ("offload_optimizer", "offload_param"):
        block = zero.pop(which, None)
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
    for key, field in _TOP_FIELDS.items():
        if key in config:
            fields[field] = config[key]
    fields["precision"] = _precision_of_config(config)
    scaling = {k: v for k, v in (config.get("fp16") or {}).items() if k in Fp16Scaling.model_fields}
    if fields["precision"] == "fp16" and scaling:
        fields["fp16"] = scaling
    explicit = {k: v for k, v in ((config.get("optimizer") or {}).get("params") or {}).items() if v != "auto"}
    if explicit and fields.get("offload_optimizer"):
        notes.append(f"optimizer params {explicit} are now 'auto': pass them as TrainingArguments (--learning_rate, "
                     "--adam_beta1/--adam_beta2, --adam_epsilon, --weight_decay)")
    if "optimizer" not in config and fields.get("offload_optimizer"):
        notes.append("added an optimizer block (DeepSpeed AdamW, 'auto' params) so DeepSpeedCPUAdam runs")
    elif "optimizer" in config and not fields.get("offload_optimizer"):
        notes.append("dropped the optimizer block: without offload the Trainer's --optim applies")
    if isinstance(config.get("activation_checkpointing"), dict):
        fields["activation_checkpointing"] = True
        notes.append("replaced the activation_checkpointing block (a no-op for HF models) by TrainingArguments "
                     "gradient_checkpointing: true")
        if config["activation_checkpointing"].get("cpu_checkpointing") is True:
            fields["activation_offload"] = True
            notes.append("kept cpu_checkpointing: true, which `hf-zero3 train` applies as activation offload "
                         "(hf_zero3/run/activation_offload.py)")
    if config.get("fp16", {}).get("enabled") is True:
        notes.append("kept fp16 as asked; on A100/H100/H200 prefer bf16 (--precision bf16)")
    fields.update(_implied_batch(fields, world_size, notes))
    extra = {k: v for k, v in config.items() if k not in _REBUILT and k in KNOWN_TOP_LEVEL_KEYS}
    unknown = sorted(k for k in config if k not in _REBUILT and k not in KNOWN_TOP_LEVEL_KEYS)
    if unknown:
        notes.append(f"dropped unknown top-level keys (DeepSpeed ignores them): {unknown}")
    if extra:
        fields["extra"] = extra
    return ZeroSpec(**fields), notes


def _precision_of_config(config: dict) -> str:
    bf16_block = config.get("bf16", config.get("bfloat16", {}))  # "bfloat16": DeepSpeed's old alias
    fp16, bf16 = config.get("fp16", {}).get("enabled"), bf16_block.get("enabled")
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
        if total % (accum * world_size) == 0:
            micro = total // (accum * world_size)
            notes.append(f"made the implied micro batch explicit: {micro} ({total} / {accum} / {world_size})")
            return {"micro_batch_size": micro}
    return {}
