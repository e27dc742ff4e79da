"""The rates an offloaded optimizer step is bound by, measured on this machine (what bounds the step):
DeepSpeedCPUAdam (parameters per second, all cores of this process), pinned host <-> GPU copies (GB/s), and the
NVMe folder's sequential write and read with O_DIRECT (GB/s, through dd).

  python benchmarks/offload_rates.py [--nvme-dir DIR] [--adam-elements 500000000] [--copy-gb 4] > rates.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time


def cpu_adam(elements: int) -> dict:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.zeros(elements, dtype=torch.float32))
    param.grad = torch.randn(elements, dtype=torch.float32) * 1e-3
    opt = DeepSpeedCPUAdam([param], lr=1e-5)
    opt.step()  # state allocation
    t0 = time.perf_counter()
    steps = 3
    for _ in range(steps):
        opt.step()
    seconds = (time.perf_counter() - t0) / steps
    return {"cpu_adam_elements": elements, "cpu_adam_s_per_step": round(seconds, 3),
            "cpu_adam_params_per_s": round(elements / seconds), "torch_threads": torch.get_num_threads()}


def copies(gb: float) -> dict:
    import torch

    n = int(gb * 1e9 / 4)
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[f"pcie_{name}_gb_per_s"] = round(3 * n * 4 / (time.perf_counter() - t0) / 1e9, 2)
    return out


def _dd(args: list[str]) -> float | None:
    """GB/s that dd reports on its last line (`... bytes ... copied, S s, R GB/s`)."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=False)
    match = re.search(r"([\d.]+) s, ", done.stderr)
    size = re.search(r"^(\d+) bytes", done.stderr, re.MULTILINE)
    if not (match and size):
        return None
    return round(int(size.group(1)) / float(match.group(1)) / 1e9, 2)


def nvme(folder: str, gb: int) -> dict:
    path = os.path.join(folder, "offload_rates.dd")
    try:
        write = _dd(["if=/dev/zero", f"of={path}", "bs=16M", f"count={gb * 64}", "oflag=direct", "conv=fsync"])
        read = _dd([f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"])
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"nvme_dir": folder, "nvme_write_gb_per_s": write, "nvme_read_gb_per_s": read, "dd_gb": gb}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nvme-dir")
    parser.add_argument("--nvme-gb", type=int, default=4)
    parser.add_argument("--adam-elements", type=int, default=500_000_000)
    parser.add_argument("--copy-gb", type=float, default=4.0)
    args = parser.parse_args(argv)
    import torch

    result = {"cpus": os.cpu_count()}
    if args.nvme_dir:
        result.update(nvme(args.nvme_dir, args.nvme_gb))
    if torch.cuda.is_available():
        result.update(copies(args.copy_gb))
    if args.adam_elements > 0:  # 0: skip (DeepSpeedCPUAdam's first use JIT-builds it; a timeout then leaves a lock)
        result.update(cpu_adam(args.adam_elements))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
