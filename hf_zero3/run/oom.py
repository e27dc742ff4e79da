"""After an out-of-memory error: the planner's next step for this run on this machine, as exact overrides.

The adapter between a running Trainer (its TrainingArguments, the model config) and the pure memory model: the run
is described by its facts (`job.facts`, the same ZeroSpec the launcher's dry run plans), the machine by
`plan.hardware` and the launcher's environment (`job.distributed`).
"""

from __future__ import annotations

import os
from typing import Any

from hf_zero3.plan.advice import oom_advice
from hf_zero3.plan.hardware import detect_hardware, gpu_count, host_ram_bytes
from hf_zero3.plan.shapes import shape_from_config
from hf_zero3.plan.types import Adapter, Hardware, Training
from hf_zero3.job.distributed import local_world_size
from hf_zero3.job.facts import RunFacts, ds_config_of


def oom_kind(error: BaseException) -> str | None:
    """"cuda" for a CUDA OOM, "host" for a failed host allocation, None otherwise (for train.py's except)."""
    import torch  # torch is loaded in any run that can run out of memory; the module imports without it

    text = str(error)
    if isinstance(error, torch.OutOfMemoryError) or "CUDA out of memory" in text:
        return "cuda"
    if isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in text or (
            "pin" in text and "out of memory" in text):
        return "host"
    return None


OOM_LOG_MARKERS = ("CUDA out of memory", "torch.OutOfMemoryError", "hf_zero3: out of GPU memory",
                   "hf_zero3: out of host memory", "DefaultCPUAllocator: can't allocate memory")
"""What a run's log holds when it ran out of memory: torch's messages and the line `hf-zero3 train` prints then."""


def oom_in_log(text: str) -> bool:
    """Whether a run's output (all ranks) says it ran out of GPU or host memory (`hf-zero3 bench`'s micro batch
    search, which tries a smaller one then)."""
    return any(marker in text for marker in OOM_LOG_MARKERS)


def this_machine(training_args: Any) -> Hardware:
    """The machines this run trains on: its world size over the launcher's ranks per node, this node's GPUs and RAM."""
    world = int(os.environ.get("WORLD_SIZE", training_args.world_size))
    local = local_world_size(min(world, max(1, gpu_count())))
    return detect_hardware(nodes=max(1, world // local), gpus_per_node=local, host_ram=host_ram_bytes())


def oom_advice_for_run(model_config: Any, training_args: Any, seq_len: int, *, host: bool = False,
                       adapter: Adapter | None = None, hardware: Hardware | None = None) -> str:
    """`oom_advice` from what train.py holds: the model config, TrainingArguments and block_size (`adapter`: a LoRA
    run's adapter, `Training.adapter`; the machines default to `this_machine`)."""
    facts = RunFacts.from_args(training_args, seq_len, model_config)
    spec = facts.spec(ds_config_of(training_args))
    training = Training(seq_len, facts.micro_batch, facts.grad_accum, facts.attention, liger=facts.liger,
                        adapter=adapter, preference=facts.preference(lora=adapter is not None))
    path = training_args.deepspeed if isinstance(training_args.deepspeed, str) else None
    return oom_advice(shape_from_config(model_config), hardware or this_machine(training_args), training, spec,
                      host=host, ds_config_path=path, sequence_parallel=facts.sequence_parallel,
                      tiled=facts.tiled_compute)
