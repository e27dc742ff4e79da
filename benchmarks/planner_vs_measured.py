"""Predicted (hf_zero3.planner) vs measured (torch.cuda.max_memory_allocated) peak GPU memory for every
GPU benchmark committed here. Regenerate the table with:  python benchmarks/planner_vs_measured.py
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_zero3.models import load_shape
from hf_zero3.planner import Hardware, Training, plan
from hf_zero3.spec import ZeroSpec

HERE = Path(__file__).resolve().parent
GiB = 1024**3
BIG_BUCKETS = dict(reduce_bucket_size=500_000_000, prefetch_bucket_size=500_000_000,
                   param_persistence_threshold=1_000_000, max_live_parameters=3_000_000_000)
H200X2 = Hardware(nodes=1, gpus_per_node=2, gpu_mem=141 * 10**9, host_ram=None)
SEQ4096 = Training(seq_len=4096, micro_batch=1, grad_accum=4)
CASES = [
    # (benchmark jsonl, variant, model, hardware, training, spec, what ran)
    ("llama3-8b-zero3_auto_buckets_2xH200_2026-11-30.jsonl", "ours", "8b", H200X2, SEQ4096,
     ZeroSpec(precision="bf16"), "ZeRO-3, auto buckets"),
    ("llama3-8b-zero3_auto_buckets_2xH200_2026-11-30.jsonl", "stock", "8b", H200X2, SEQ4096,
     ZeroSpec(precision="bf16", activation_checkpointing=True), "ZeRO-3 + checkpointing (stock template)"),
    ("llama3-8b-zero3_big_buckets_2xH200_2026-11-30.jsonl", "ours", "8b", H200X2, SEQ4096,
     ZeroSpec(precision="bf16", **BIG_BUCKETS), "ZeRO-3, 5e8 buckets"),
    ("llama3-8b_2xH200_2026-11-30.jsonl", "ours", "8b", H200X2, SEQ4096,
     ZeroSpec(precision="bf16", **BIG_BUCKETS), "ZeRO-3, 5e8 buckets (recipe 8b v1)"),
    ("llama3-8b_2xH200_2026-11-30.jsonl", "stock", "8b", H200X2, SEQ4096,
     ZeroSpec(precision="bf16", activation_checkpointing=True), "ZeRO-3 + checkpointing (stock template)"),
    ("llama3-8b-zero2_2xH200_2026-11-30.jsonl", "ours", "8b", H200X2, SEQ4096, ZeroSpec(stage=2, precision="bf16"),
     "ZeRO-2"),
]


def measured_peak_gib(jsonl: str, variant: str) -> float:
    rows = [json.loads(line) for line in (HERE / jsonl).read_text().splitlines()]
    return max(r["gpu_peak_allocated_gb"] for r in rows if r["variant"] == variant and "gpu_peak_allocated_gb" in r)


def table() -> str:
    lines = ["| benchmark | config | predicted GiB | measured GiB | error |", "|---|---|---|---|---|"]
    for jsonl, variant, model, hardware, training, spec, what in CASES:
        predicted = plan(load_shape(model), hardware, training, spec).gpu_allocated_bytes / GiB
        measured = measured_peak_gib(jsonl, variant)
        lines.append(f"| {jsonl.removesuffix('.jsonl')} ({variant}) | {what} | {predicted:.1f} | {measured:.1f} | "
                     f"{(predicted - measured) / measured:+.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
