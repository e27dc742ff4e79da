"""Process-group set-up that the stock stack leaves to the user, done before TrainingArguments exist.

On a CPU-only machine DeepSpeed needs gloo initialised *before* TrainingArguments is created (else it
sees world size 1 and fails on batch math); a single process started without a launcher needs the
RANK/WORLD_SIZE/MASTER_* variables (else DeepSpeed looks for MPI); and the DeepSpeed launcher leaves
OMP_NUM_THREADS unset, so every rank grabs every core and the run slows down ~3x.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port that is free on this host right now (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def is_world_process_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def prepare_process_group(on_cpu: bool, use_deepspeed: bool) -> None:
    """Fill in single-process launcher variables and, on CPU, start DeepSpeed's gloo process group."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not on_cpu:
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        threads = max(1, (os.cpu_count() or 1) // max(1, local_ranks))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if use_deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
