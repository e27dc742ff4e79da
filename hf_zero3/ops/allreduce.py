"""A real all-reduce over every rank, started by the same launcher as training (the seed's `test_nccl.py`).

    deepspeed --num_gpus 2 --master_port P --module hf_zero3.ops.allreduce
    torchrun --nproc_per_node 2 --master_port P -m hf_zero3.ops.allreduce

Each rank all-reduces tensors of a few sizes (NCCL on GPUs, gloo on CPU), checks the result is the exact
expected sum, and rank 0 prints algorithm and bus bandwidth as nccl-tests defines them
(busbw = algbw * 2(n-1)/n, comparable across world sizes) plus one `RESULT_TAG {json}` line for the doctor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

RESULT_TAG = "HF_ZERO3_ALLREDUCE"


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one all-reduce of `nbytes` taking `seconds` (nccl-tests' definition)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def measure(size_bytes: int, iters: int, warmup: int, device: torch.device) -> dict:
    """Check one all-reduce exactly, then time `iters` of them; the slowest rank's time counts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = size_bytes // 4
    # Distinct per-element values (exact in float32) so a misplaced or dropped chunk changes the sum.
    base = (torch.arange(numel, device=device) % 1024).float()
    data = base * (rank + 1)
    dist.all_reduce(data)
    expected = base * (world * (world + 1) // 2)
    if not torch.equal(data, expected):
        bad = (data != expected).nonzero()[0].item()
        raise RuntimeError(f"rank {rank}: all-reduce of {size_bytes} bytes gave {data[bad].item()} at index "
                           f"{bad}, expected {expected[bad].item()}")
    buf = torch.zeros(numel, device=device)
    for _ in range(warmup):
        dist.all_reduce(buf)
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    algbw, busbw = bus_bandwidth(numel * 4, elapsed.item(), world)
    return {"bytes": numel * 4, "time_us": elapsed.item() * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,16,64", help="comma-separated message sizes in MiB")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with CUDA, else gloo")
    parser.add_argument("--timeout-s", type=int, default=120, help="fail instead of hanging on a dead peer")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the DeepSpeed launcher
    args = parser.parse_args(argv)

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        sizes = [int(float(mb) * 2**20) for mb in args.sizes_mb.split(",")]
        results = [measure(size, args.iters, args.warmup, device) for size in sizes]
        if dist.get_rank() == 0:
            world = dist.get_world_size()
            for r in results:
                print(f"all-reduce {r['bytes'] / 2**20:8.1f} MiB  {r['time_us']:10.1f} us  "
                      f"algbw {r['algbw_gbps']:7.3f} GB/s  busbw {r['busbw_gbps']:7.3f} GB/s")
            summary = {"backend": backend, "world_size": world, "device": device.type, "results": results}
            print(f"{RESULT_TAG} {json.dumps(summary)}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
