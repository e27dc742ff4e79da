"""The user's intent for DeepSpeed, as strict pydantic models.

These models are the only input of `build_ds_config`. They are strict on purpose: a typo in a
field name is an error (`extra="forbid"`), never a setting that silently does nothing.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

Auto = Literal["auto"]
"""Placeholder that transformers' DeepSpeed bridge replaces with a TrainingArguments value."""

PositiveIntOrAuto = Union[Auto, int]

EVERY_PARAMETER = 2**63 - 1
"""A `param_persistence_threshold` that keeps every parameter whole (DeepSpeed's own "no limit", sys.maxsize). On one
rank without parameter offload, ZeRO-3's gathers are views of the partition (DeepSpeed 0.19 `NoGatherHandle`), so it
costs no memory; it skips the per-module fetch and the stream synchronization each fetch waits on. Measured on a 7B,
1 x H200, global batch 16: 1.33x tokens/s, the same peak memory
(benchmarks study persistence-7b-1gpu)."""


class Strict(BaseModel):
    """Base for every spec model: unknown fields are errors, field docstrings are the docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class Fp16Scaling(Strict):
    """Loss-scaling knobs of fp16 training (DeepSpeed's `fp16` block)."""

    loss_scale: float = Field(0.0, ge=0)
    """0 selects dynamic loss scaling; a positive number fixes the scale."""
    initial_scale_power: int = Field(16, ge=0, le=32)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = Field(1000, ge=1)
    """Steps without overflow before the scale is raised."""
    hysteresis: int = Field(2, ge=1)
    """Overflows tolerated before the scale is lowered."""
    min_loss_scale: float = Field(1.0, gt=0)
    """Floor of the dynamic scale."""


class OptimizerOffload(Strict):
    """Where the fp32 master weights and Adam states live (`zero_optimization.offload_optimizer`)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """"none" keeps them on the GPU; "cpu" in host RAM (DeepSpeedCPUAdam steps there); "nvme" on disk."""
    nvme_path: str | None = None
    """Directory on a fast local NVMe mount; required when device is "nvme"."""
    pin_memory: bool = True
    """Page-locked host buffers: faster host<->GPU copies, but the RAM cannot be swapped."""
    buffer_count: int = Field(4, ge=1)
    """Swap buffers for NVMe offload (DeepSpeed's default: 4)."""
    ratio: float = Field(1.0, gt=0.0, le=1.0)
    """Partial offload (`offload_optimizer.ratio`, ZeRO-3 + device "cpu" only): the fraction of the optimizer's
    sub-groups stepped on the CPU; the first (1 - ratio) of them keep fp32 master weights, Adam m, v and fp32
    gradients on the GPU (stepped by torch AdamW). DeepSpeed 0.19 `stage3.py::_create_fp32_partitions`."""

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> OptimizerOffload:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError('device "nvme" needs nvme_path: a directory on a local NVMe mount')
        if self.ratio < 1.0 and self.device != "cpu":
            raise ValueError(f'ratio {self.ratio} (partial offload) needs device "cpu" (device is "{self.device}"): '
                             'set device "cpu" or ratio 1.0')
        return self


class ParamOffload(OptimizerOffload):
    """Where the 16-bit parameters live between uses (`zero_optimization.offload_param`, ZeRO-3 only)."""

    buffer_count: int = Field(5, ge=1)
    """Swap buffers for NVMe offload (DeepSpeed's default: 5)."""
    buffer_size: int = Field(100_000_000, ge=1)
    """Elements per NVMe swap buffer; must hold the largest parameter (e.g. the embedding)."""
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    """Parameter elements kept in host RAM when offloading to NVMe."""


class AioSpec(Strict):
    """Asynchronous I/O settings for NVMe offload (DeepSpeed's `aio` block)."""

    block_size: int = Field(1_048_576, ge=4096)
    queue_depth: int = Field(8, ge=1)
    intra_op_parallelism: int = Field(1, ge=1)
    single_submit: bool = False
    overlap_events: bool = True


class ZeroSpec(Strict):
    """What a user wants from DeepSpeed ZeRO; `build_ds_config` turns it into a ds_config dict."""

    stage: int = Field(3, ge=0, le=3)
    """ZeRO stage: 1 partitions optimizer states, 2 adds gradients, 3 adds parameters."""
    precision: Literal["bf16", "fp16", "fp32", "auto"] = "bf16"
    """Training precision. "auto" follows TrainingArguments' --bf16/--fp16 (the stock HF template)."""
    fp16: Fp16Scaling = Fp16Scaling()
    """Loss scaling, used only when precision is "fp16"."""
    offload_optimizer: OptimizerOffload = OptimizerOffload()
    """Offload of optimizer states (stage 1-3)."""
    offload_param: ParamOffload = ParamOffload()
    """Offload of parameters (stage 3 only)."""
    aio: AioSpec = AioSpec()
    """Async I/O settings, written only when something is offloaded to NVMe."""
    overlap_comm: bool = True
    """Overlap gradient reduction with the backward pass."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_bucket_size: PositiveIntOrAuto = "auto"
    """Elements reduced at once; "auto" lets the HF bridge pick hidden_size**2."""
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    """Elements all-gathered at once (stages 1-2)."""
    prefetch_bucket_size: PositiveIntOrAuto = "auto"
    """ZeRO-3: parameter elements fetched ahead; "auto" = 0.9 * hidden_size**2."""
    param_persistence_threshold: PositiveIntOrAuto = "auto"
    """ZeRO-3: parameter tensors of at most this many elements stay whole on every GPU, beside their partitions;
    "auto" = 10 * hidden_size (the norms). On one GPU the planner sets EVERY_PARAMETER."""
    max_live_parameters: int = Field(1_000_000_000, ge=1)
    """ZeRO-3: most parameter elements gathered at once (caps peak memory)."""
    max_reuse_distance: int = Field(1_000_000_000, ge=0)
    """ZeRO-3: keep a gathered parameter if it is reused within this many elements."""
    sub_group_size: int = Field(1_000_000_000, ge=1)
    """ZeRO-3: optimizer step granularity in elements (smaller = less peak memory with offload)."""
    gradient_clipping: Union[Auto, float] = "auto"
    """Max gradient norm; "auto" follows TrainingArguments.max_grad_norm."""
    micro_batch_size: PositiveIntOrAuto = "auto"
    """Per-GPU batch; "auto" follows --per_device_train_batch_size."""
    gradient_accumulation_steps: PositiveIntOrAuto = "auto"
    """Micro-batches per optimizer step; "auto" follows --gradient_accumulation_steps."""
    global_batch_size: PositiveIntOrAuto = "auto"
    """train_batch_size = micro x accumulation x world size; "auto" lets the bridge compute it."""
    activation_checkpointing: bool = False
    """Recompute activations in backward. For HF models this is TrainingArguments.gradient_checkpointing,
    not DeepSpeed's activation_checkpointing block (which HF models never call)."""
    checkpointed_layers: Union[int, None] = Field(None, ge=1)
    """With activation_checkpointing: checkpoint only the first N decoder layers, the others keep their activations
    and skip their recompute (TrainingArguments `gradient_checkpointing_layers`, applied by `hf-zero3 train`);
    None: all layers."""
    activation_offload: bool = False
    """Keep the activations saved for backward in pinned host memory (with checkpointing: the checkpointed layer
    inputs). Written as DeepSpeed's `activation_checkpointing.cpu_checkpointing`, which `hf-zero3 train` applies
    through hf_zero3.model.activation_offload (DeepSpeed alone applies it only to models calling its checkpointing)."""
    wall_clock_breakdown: bool = False
    """DeepSpeed times forward/backward/step and all-gathers (costs a sync per timer)."""
    gather_16bit_weights_on_save: bool = True
    """ZeRO-3: gather full 16-bit weights when saving, so checkpoints hold loadable weights."""
    steps_per_print: int | None = Field(2000, ge=1)
    """DeepSpeed's own progress print interval (our callbacks do the logging); None: never, DeepSpeed 0.19's default,
    which a ds_config says as `inf` (accelerate writes that into the config a Trainer runs with) or by leaving the
    key out."""
    extra: dict[str, Any] = {}
    """Top-level DeepSpeed blocks the spec does not model (e.g. flops_profiler), copied verbatim."""

    @model_validator(mode="after")
    def _consistent(self) -> ZeroSpec:
        problems = []
        if self.checkpointed_layers is not None and not self.activation_checkpointing:
            problems.append(f"checkpointed_layers {self.checkpointed_layers} needs activation_checkpointing: set it "
                            "true or drop checkpointed_layers")
        if self.checkpointed_layers is not None and self.activation_offload:
            problems.append("checkpointed_layers with activation_offload would copy whole layers' activations over "
                            "PCIe: drop one of them")
        if self.offload_param.device != "none" and self.stage != 3:
            problems.append(f"offload_param needs stage 3 (stage is {self.stage}): set stage 3 or drop it")
        if self.offload_optimizer.device != "none" and self.stage == 0:
            problems.append("offload_optimizer needs ZeRO stage 1, 2 or 3: set stage 3")
        if self.offload_optimizer.device == "nvme" and self.stage in (1, 2):
            problems.append(f'offload_optimizer device "nvme" needs stage 3 (stage is {self.stage}): stages 1 and 2 '
                            'offload to host RAM whatever the device and ignore nvme_path; set stage 3 or device "cpu"')
        if self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            problems.append(f"offload_optimizer.ratio {self.offload_optimizer.ratio} (partial offload) needs ZeRO "
                            f"stage 3 (stage is {self.stage}): set stage 3 or ratio 1.0")
        for name in ("gradient_clipping",):
            value = getattr(self, name)
            if value != "auto" and not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be a finite number >= 0 or 'auto' (got {value})")
        for name in ("reduce_bucket_size", "micro_batch_size", "gradient_accumulation_steps", "global_batch_size"):
            value = getattr(self, name)
            if value != "auto" and value < 1:
                problems.append(f"{name} must be a positive integer or 'auto' (got {value})")
        sizes = (self.global_batch_size, self.micro_batch_size, self.gradient_accumulation_steps)
        if all(isinstance(v, int) and v >= 1 for v in sizes) and sizes[0] % (sizes[1] * sizes[2]):
            problems.append(f"global_batch_size {sizes[0]} is not a multiple of micro_batch_size {sizes[1]} x "
                            f"gradient_accumulation_steps {sizes[2]}, so no world size fits: make it a multiple of "
                            f"{sizes[1] * sizes[2]}, or set one of the three to 'auto'")
        for name in ("prefetch_bucket_size", "param_persistence_threshold"):
            value = getattr(self, name)
            if value != "auto" and value < 0:
                problems.append(f"{name} must be >= 0 or 'auto' (got {value})")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def offloads_to_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer.device, self.offload_param.device)


SETTINGS = ("stage", "precision", "gradient_clipping", "micro_batch_size", "gradient_accumulation_steps",
            "global_batch_size", "sub_group_size", "reduce_bucket_size", "activation_checkpointing",
            "activation_offload", "wall_clock_breakdown", "overlap_comm", "contiguous_gradients",
            "gather_16bit_weights_on_save")
"""The `ZeroSpec` fields `hf-zero3 config new` sets one by one (the offload blocks have their own flags)."""


def changed_fields(fields: dict[str, Any], settings: dict[str, Any], offload: dict[str, str | None],
                   nvme_path: str | None, optimizer: dict[str, Any]) -> dict[str, Any]:
    """A spec's fields (a starting spec's, dumped) with the changes asked: `settings` (fields of `SETTINGS`, None
    for unchanged), `offload` (a device for offload_optimizer and offload_param, None for unchanged), an NVMe
    directory for both, and the optimizer offload's `ratio` and `pin_memory`. ValueError naming the flag to add."""
    fields = {**fields, **{k: v for k, v in settings.items() if v is not None}}
    for name, device in offload.items():
        if device is not None:
            fields[name] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        elif nvme_path and fields.get(name, {}).get("device") == "nvme":
            fields[name] = {**fields[name], "nvme_path": nvme_path}
    for key, value in optimizer.items():
        if value is None:
            continue
        if fields.get("offload_optimizer", {}).get("device", "none") == "none":
            flag = "--offload-ratio" if key == "ratio" else "--pin-memory/--no-pin-memory"
            raise ValueError(f"{flag} sets how the optimizer states are offloaded, but they are not: add "
                             "--offload-optimizer cpu")
        fields["offload_optimizer"] = {**fields.get("offload_optimizer", {}), key: value}
    for name in ("offload_optimizer", "offload_param"):
        if fields.get(name, {}).get("device") == "nvme" and not fields[name].get("nvme_path"):
            raise ValueError(f"--{name.replace('_', '-')} nvme needs --nvme-path DIR: a directory on a local NVMe "
                             "mount")
    return fields
