"""The findings of a ds_config's `zero_optimization` block: offload and its stage, partial offload, SuperOffload,
the NVMe paths, the 16-bit gather at save, the persistence threshold on several GPUs, and the
`activation_checkpointing` block HF models never read. Each is what DeepSpeed 0.19 asserts once the model has
loaded, or silently ignores.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from hf_zero3.config.build import OFFLOADED_OPTIMIZER_BLOCK
from hf_zero3.config.findings import Finding, lookup


def super_offload(config: dict, device: str | None) -> list[Finding]:
    """`offload_optimizer.super_offload` (DeepSpeed's CPU Adam step overlapped with backward): what DeepSpeed 0.19
    asserts once the model has loaded, or ignores."""
    key = "zero_optimization.offload_optimizer.super_offload"
    if lookup(config, key) is not True:
        return []
    stage = lookup(config, "zero_optimization.stage", 0)
    opt_device = lookup(config, "zero_optimization.offload_optimizer.device")
    if stage != 3 or opt_device != "cpu":
        return [Finding("error", key, f"SuperOffload needs ZeRO stage 3 with offload_optimizer.device 'cpu' (stage is "
                                      f"{stage}, device {opt_device!r}): set both, or remove super_offload")]
    if device == "cpu":
        return [Finding("error", key, "SuperOffload runs on NVIDIA GPUs only (DeepSpeed asserts a CUDA accelerator "
                                      "after the model has loaded): remove super_offload for a run on CPU")]
    return []


def zero(config: dict) -> list[Finding]:
    findings = []
    stage = lookup(config, "zero_optimization.stage", 0)
    param_device = lookup(config, "zero_optimization.offload_param.device", "none")
    opt_device = lookup(config, "zero_optimization.offload_optimizer.device", "none")
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
                                   lookup(config, f"zero_optimization.{which}.nvme_path"))
    findings += _activation_checkpointing(config.get("activation_checkpointing"))
    gather = lookup(config, "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                  lookup(config, "zero_optimization.stage3_gather_fp16_weights_on_model_save", None))
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


def persistence(config: dict, world_size: int | None) -> list[Finding]:
    """The one-GPU setting `stage3_param_persistence_threshold: EVERY_PARAMETER` taken to more GPUs keeps the whole
    16-bit model on each of them, beside its partitions."""
    threshold = lookup(config, "zero_optimization.stage3_param_persistence_threshold")
    if (lookup(config, "zero_optimization.stage", 0) != 3 or not world_size or world_size < 2
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
                                "applied by `hf-zero3 train` as activation offload (hf_zero3/model/activation_offload.py"
                                "): the activations the decoder saves for backward, with gradient_checkpointing the "
                                "checkpointed layer inputs, live in pinned host memory. DeepSpeed alone does not "
                                "apply it to HF models: with a plain `--deepspeed` script it does nothing unless the "
                                "script calls hf_zero3.model.activation_offload.enable(model) before its Trainer"))
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
    key = "zero_optimization.offload_optimizer.ratio"
    ratio = lookup(config, key)
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
    opt_type = str(lookup(config, "optimizer.type", "")).lower()
    if opt_device == "cpu" and (opt_type not in ("adam", "adamw")
                                or config.get("zero_force_ds_cpu_optimizer") is False):
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
