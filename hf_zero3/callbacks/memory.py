"""Per-step GPU and host memory of every rank: what `nvidia-smi dmon` and DeepSpeed's logs were used for."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_zero3.callbacks._console import say
from hf_zero3.callbacks._logs import merge_into_logs
from hf_zero3.job.distributed import gather_from_ranks
from hf_zero3.units import GIB


def host_memory() -> dict[str, float]:
    """This process's resident memory now and at its peak so far (a transient at start-up, e.g. a model copy while
    loading, shows only there), and the machine's available RAM, in GiB."""
    import resource

    import psutil

    rss = psutil.Process(os.getpid()).memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; the kernel updates it lazily
    return {"host_rss_gib": rss / GIB, "host_peak_rss_gib": max(rss, peak) / GIB,
            "host_available_gib": psutil.virtual_memory().available / GIB}


def gpu_memory() -> dict[str, float]:
    """torch's view of this rank's GPU (allocated, reserved, peaks, pinned host) and NVML's, if present."""
    import torch

    if not torch.cuda.is_available():
        return {}
    device = torch.cuda.current_device()
    stats = {
        "gpu_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "gpu_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
    }
    try:
        stats["pinned_host_gib"] = torch.cuda.host_memory_stats()["allocated_bytes.current"] / GIB
    except (AttributeError, KeyError, RuntimeError):
        pass
    stats.update(_nvml(device))
    return stats


def _nvml(device: int) -> dict[str, float]:
    """Device-level figures through torch's NVML helpers, which map CUDA_VISIBLE_DEVICES (indices, UUIDs,
    MIG) and CUDA_DEVICE_ORDER to the right NVML device; absent without nvidia-ml-py."""
    import torch

    try:
        return {"gpu_used_gib": torch.cuda.device_memory_used(device) / GIB,
                "gpu_util_pct": float(torch.cuda.utilization(device)),
                "gpu_power_w": torch.cuda.power_draw(device) / 1000}
    except (ImportError, ModuleNotFoundError, RuntimeError, AttributeError, ValueError):
        return {}


class MemoryCallback(TrainerCallback):
    """Memory of every rank at every logging step: into the Trainer's logs (max over ranks, so TensorBoard
    and any `report_to` get them), one row per rank into `<output_dir>/memory.jsonl`, and a compact line on
    rank 0. On CPU only the host figures appear.

    Precondition: every rank logs at the same steps (the Trainer does), since the figures are gathered.

    Args:
        filename: JSONL file inside `args.output_dir`.
        print_line: print the compact line on rank 0.
    """

    def __init__(self, filename: str = "memory.jsonl", print_line: bool = True):
        self.filename = filename
        self.print_line = print_line

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # training steps only: eval/summary records are not per step
            return
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        record: dict[str, Any] = {"rank": rank, **gpu_memory(), **host_memory()}
        records = gather_from_ranks(record)
        if not state.is_world_process_zero:
            return
        worst = {key: round(max(r[key] for r in records if key in r), 4)
                 for key in records[0] if key not in ("rank", "host_available_gib")}
        worst["host_available_gib"] = round(min(r["host_available_gib"] for r in records), 4)
        merge_into_logs(state, logs, worst)
        path = Path(args.output_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for r in records:
                f.write(json.dumps({"step": state.global_step, **{k: v for k, v in r.items()}}) + "\n")
        if self.print_line:
            parts = [f"step {state.global_step}"]
            if "gpu_peak_allocated_gib" in worst:
                parts.append(f"gpu peak {worst['gpu_peak_allocated_gib']:.2f}/{worst['gpu_peak_reserved_gib']:.2f} "
                             "GiB alloc/reserved")
            ranks = f"max of {len(records)} ranks" if len(records) > 1 else "one rank"
            parts.append(f"host rss {worst['host_rss_gib']:.2f} GiB ({ranks}), "
                         f"available {worst['host_available_gib']:.1f} GiB")
            say("hf_zero3 memory: " + " | ".join(parts))  # through tqdm: the Trainer's bar stays whole
