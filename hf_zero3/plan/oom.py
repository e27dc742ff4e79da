"""After an out-of-memory error: the planner's next step for this run on this machine, as exact overrides.

The adapter between a running Trainer (its TrainingArguments, the model config) and the pure memory model.
"""

from __future__ import annotations

import os
from typing import Any

from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.hardware import detect_hardware, gpu_count, host_ram_bytes
from hf_zero3.plan.memory import Training, oom_advice


def oom_kind(error: BaseException) -> str | None:
    """"cuda" for a CUDA OOM, "host" for a failed host allocation, None otherwise (for train.py's except)."""
    import torch

    text = str(error)
    if isinstance(error, torch.OutOfMemoryError) or "CUDA out of memory" in text:
        return "cuda"
    if isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in text or (
            "pin" in text and "out of memory" in text):
        return "host"
    return None


def oom_advice_for_run(model_config: Any, training_args: Any, seq_len: int, *, host: bool = False,
                       trainable: int | None = None) -> str:
    """`oom_advice` from what train.py holds: the model config, TrainingArguments and block_size (`trainable`: a LoRA
    run's adapter parameters, `Training.trainable`)."""
    from hf_zero3.config.convert import spec_from_ds_config
    from hf_zero3.plan.shapes import shape_from_config
    from hf_zero3.run.facts import RunFacts

    facts = RunFacts.from_args(training_args, seq_len, model_config)
    ds = training_args.hf_deepspeed_config.config if getattr(training_args, "hf_deepspeed_config", None) else None
    fields = spec_from_ds_config(ds)[0].model_dump(exclude_unset=True) if ds else {"stage": 0}
    offload = fields.get("activation_offload", False) or facts.activation_offload
    spec = ZeroSpec(**{**fields, "precision": facts.precision, **facts.checkpointing(offload),
                       "activation_offload": offload})
    world = int(os.environ.get("WORLD_SIZE", training_args.world_size))
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")  # torchrun / deepspeed launcher
    local = int(local) if local else min(world, max(1, gpu_count()))
    hardware = detect_hardware(nodes=max(1, world // local), gpus_per_node=local, host_ram=host_ram_bytes())
    training = Training(seq_len, facts.micro_batch, facts.grad_accum, facts.attention, liger=facts.liger,
                        trainable=trainable)
    path = training_args.deepspeed if isinstance(training_args.deepspeed, str) else None
    return oom_advice(shape_from_config(model_config), hardware, training, spec, host=host, ds_config_path=path)
