"""`build_ds_config(spec) -> dict`: the one place a DeepSpeed config is written.

Policy
------
* `"auto"` is emitted only for keys that transformers' DeepSpeed bridge (`HfTrainerDeepSpeedConfig`)
  fills from TrainingArguments or the model: the batch sizes, gradient clipping, fp16/bf16 `enabled`,
  the optimizer's lr/betas/eps/weight_decay, and the three hidden-size based ZeRO sizes
  (`BRIDGE_FILLED_KEYS`). Everything else is written explicitly, because DeepSpeed drops an unfilled
  `"auto"` silently and falls back to its own default.
* When the optimizer is offloaded, DeepSpeed's own optimizer block (AdamW, `"auto"` params) is
  written, so that DeepSpeedCPUAdam steps on the CPU. Without it the Trainer hands DeepSpeed a torch
  AdamW, and DeepSpeed refuses ZeRO-Offload with a client optimizer (or steps slowly with it).
  Without offload no optimizer block is written: the Trainer's fused torch AdamW is used and its
  `--optim`/`--lr_scheduler_type` keep working.
* No `scheduler` block: the Trainer's scheduler (`--lr_scheduler_type`, `--warmup_steps`) applies.
* DeepSpeed's `activation_checkpointing` block (`partition_activations`, `cpu_checkpointing`) only
  configures `deepspeed.checkpointing.checkpoint`, which HF models never call. Activation
  checkpointing intent is therefore mapped to TrainingArguments (`training_args_overrides`). Activation
  offload (`spec.activation_offload`) is written as `activation_checkpointing: {cpu_checkpointing: true}`: the
  config carries it to `hf-zero3 train`, which applies it (hf_zero3.model.activation_offload); for DeepSpeed the
  block stays inert.
"""

from __future__ import annotations

import copy
from typing import Any

from hf_zero3.config.spec import ZeroSpec

BRIDGE_FILLED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.enabled",
        "bf16.enabled",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.total_num_steps",
        "scheduler.params.warmup_num_steps",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    }
)
"""Dotted keys whose `"auto"` transformers' `HfTrainerDeepSpeedConfig` replaces (transformers 5.x)."""

OFFLOADED_OPTIMIZER_BLOCK = {
    "type": "AdamW",
    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
}


def build_ds_config(spec: ZeroSpec) -> dict[str, Any]:
    """Turn a validated spec into a DeepSpeed config dict (pure: same spec, same dict)."""
    config: dict[str, Any] = {}
    config.update(_precision_blocks(spec))
    if spec.offload_optimizer.device != "none":
        config["optimizer"] = copy.deepcopy(OFFLOADED_OPTIMIZER_BLOCK)
    config["zero_optimization"] = _zero(spec)
    if spec.offloads_to_nvme:
        config["aio"] = spec.aio.model_dump()
    config["gradient_clipping"] = spec.gradient_clipping
    config["train_batch_size"] = spec.global_batch_size
    config["train_micro_batch_size_per_gpu"] = spec.micro_batch_size
    config["gradient_accumulation_steps"] = spec.gradient_accumulation_steps
    if spec.steps_per_print is not None:
        config["steps_per_print"] = spec.steps_per_print
    config["wall_clock_breakdown"] = spec.wall_clock_breakdown
    if spec.activation_offload:
        config["activation_checkpointing"] = {"cpu_checkpointing": True}
    clashes = sorted(set(spec.extra) & set(config))
    if clashes:
        raise ValueError(f"extra blocks {clashes} collide with generated keys: set them through the spec fields")
    config.update(copy.deepcopy(spec.extra))
    return config


def training_args_overrides(spec: ZeroSpec) -> dict[str, Any]:
    """TrainingArguments that must accompany the config for the spec's intent to take effect."""
    overrides: dict[str, Any] = {}
    if spec.activation_checkpointing:
        overrides["gradient_checkpointing"] = True
        overrides["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        if spec.checkpointed_layers is not None:
            overrides["gradient_checkpointing_layers"] = spec.checkpointed_layers
    if spec.precision in ("bf16", "fp16"):
        overrides[spec.precision] = True
    for arg, value in (
        ("per_device_train_batch_size", spec.micro_batch_size),
        ("gradient_accumulation_steps", spec.gradient_accumulation_steps),
        ("max_grad_norm", spec.gradient_clipping),
    ):
        if value != "auto":
            overrides[arg] = value
    return overrides


def _precision_blocks(spec: ZeroSpec) -> dict[str, Any]:
    if spec.precision == "auto":
        return {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    if spec.precision == "bf16":
        return {"bf16": {"enabled": True}}
    if spec.precision == "fp16":
        return {"fp16": {"enabled": True, **spec.fp16.model_dump()}}
    return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}


def _offload(offload, *, param: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"device": offload.device, "pin_memory": offload.pin_memory}
    if offload.device == "nvme":
        block["nvme_path"] = offload.nvme_path
        block["buffer_count"] = offload.buffer_count
        if param:
            block["buffer_size"] = offload.buffer_size
            block["max_in_cpu"] = offload.max_in_cpu
    if not param and offload.ratio < 1.0:
        block["ratio"] = offload.ratio
    return block


def _zero(spec: ZeroSpec) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": spec.stage,
        "overlap_comm": spec.overlap_comm,
        "contiguous_gradients": spec.contiguous_gradients,
        "reduce_bucket_size": spec.reduce_bucket_size,
    }
    if spec.offload_optimizer.device != "none":
        zero["offload_optimizer"] = _offload(spec.offload_optimizer, param=False)
    if spec.stage == 3:
        if spec.offload_param.device != "none":
            zero["offload_param"] = _offload(spec.offload_param, param=True)
        zero.update(
            {
                "sub_group_size": spec.sub_group_size,
                "stage3_prefetch_bucket_size": spec.prefetch_bucket_size,
                "stage3_param_persistence_threshold": spec.param_persistence_threshold,
                "stage3_max_live_parameters": spec.max_live_parameters,
                "stage3_max_reuse_distance": spec.max_reuse_distance,
                "stage3_gather_16bit_weights_on_model_save": spec.gather_16bit_weights_on_save,
            }
        )
    elif spec.stage in (1, 2):
        zero["allgather_bucket_size"] = spec.allgather_bucket_size
    return zero
