"""This machine, as the planner and the operations need it: GPUs, their memory, host RAM, NVMe, versions.

Why one owner: GPU counting and hardware detection were written three times (the CLI, the planner, the doctor)
and the bench read versions by importing torch and DeepSpeed; the memory model (`plan.memory`) stays pure
arithmetic over a `Hardware` it is given.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil

from hf_zero3.plan.types import Hardware, PlanError

VERSIONED = ("torch", "deepspeed", "transformers", "accelerate", "liger-kernel", "flash-attn", "peft", "torchao")
"""The packages whose versions a benchmark or a checkpoint records (the ones not installed are left out)."""


def gpu_count() -> int:
    """CUDA GPUs visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_name() -> str | None:
    """This rank's GPU as torch names it (e.g. "NVIDIA H200"), None without CUDA."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def host_ram_bytes() -> int:
    """Physical RAM of this machine."""
    import psutil

    return int(psutil.virtual_memory().total)


def detect_hardware(nodes: int | None = None, gpus_per_node: int | None = None, gpu_mem: int | None = None,
                    host_ram: int | None = None, nvme_path: str | None = None,
                    nvme_free: int | None = None) -> Hardware:
    """Hardware from the given values, the rest read from this machine (and listed in `detected`).

    Host RAM is read from this machine only when the GPUs are too: planning for other GPUs (--gpus or
    --gpu-mem given) with this laptop's RAM would reject every offload option for the wrong reason, so
    there it stays unknown (None) and the plan reports what it needs instead.
    """
    detected = []
    elsewhere = gpus_per_node is not None or gpu_mem is not None
    if gpus_per_node is None or gpu_mem is None:
        count = gpu_count()
        if count == 0:
            raise PlanError("no GPU found on this machine: pass --gpus N and --gpu-mem SIZE (e.g. --gpus 8 "
                            "--gpu-mem 80GB) for the GPUs you plan for")
        if gpus_per_node is None:
            gpus_per_node = count
            detected.append("gpus_per_node")
        if gpu_mem is None:
            import torch

            gpu_mem = torch.cuda.get_device_properties(0).total_memory
            detected.append("gpu_mem")
    if host_ram is None and not elsewhere:
        host_ram = host_ram_bytes()
        detected.append("host_ram")
    if nvme_path and nvme_free is None:
        if not os.path.isdir(nvme_path):
            raise PlanError(f"NVMe path {nvme_path} is not a directory: create it on the NVMe mount, or pass "
                            "--nvme-free SIZE to plan for another machine")
        nvme_free = shutil.disk_usage(nvme_path).free
        detected.append("nvme_free")
    return Hardware(nodes or 1, gpus_per_node, gpu_mem, host_ram, nvme_path, nvme_free or 0, tuple(detected))


def default_ranks() -> int:
    """One rank per visible GPU, or 2 CPU ranks (enough to exercise a real all-reduce and ZeRO partitioning)."""
    return gpu_count() or 2


def versions() -> dict[str, str]:
    """Python and the installed versions of `VERSIONED`, from package metadata (nothing is imported)."""
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found
