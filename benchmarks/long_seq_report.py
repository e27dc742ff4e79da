"""The table of a `gpu_long_seq_8b.sh` sitting: per run (side:length) whether it trained its steps or ran out of
memory, its step time, its memory against the plan, and the longest length each side trained at.
Usage:  python3 benchmarks/long_seq_report.py WORK_DIR OUT.md   (the script runs it after every run)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

GiB = 1024**3


def run_row(folder: Path) -> dict:
    """One run's facts from its folder, runs/NN_side_length/: rc.txt, plan.txt, train_log.jsonl, stdout.log and
    gpu_mib.txt, as the script leaves them."""
    _, side, length = folder.name.split("_")
    read = lambda name: (folder / name).read_text() if (folder / name).is_file() else ""  # noqa: E731
    logs = [json.loads(line) for line in read("train_log.jsonl").splitlines() if line.strip()]
    steps = [r for r in logs if "step_time_s" in r]
    planned = re.search(r"max_memory_allocated predicted: ([\d.]+) GB", read("plan.txt"))
    smi = [int(x) for x in read("gpu_mib.txt").split() if x.isdigit()]
    return {"side": side, "length": int(length), "rc": read("rc.txt").strip() or "?",
            "oom": bool(re.search(r"OutOfMemoryError|CUDA out of memory", read("stdout.log"))), "steps": len(steps),
            "step_s": statistics.median(r["step_time_s"] for r in steps[1:]) if len(steps) > 1 else None,
            "allocated": max((r.get("gpu_peak_allocated_gib", 0) for r in steps), default=None),
            "reserved": max((r.get("gpu_peak_reserved_gib", 0) for r in steps), default=None),
            "planned": float(planned.group(1)) * 1e9 / GiB if planned else None,
            "smi": max(smi) / 1024 if smi else None}


def _cell(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def report(work: Path, wanted_steps: int) -> str:
    rows = [run_row(f) for f in sorted((work / "runs").iterdir()) if f.is_dir() and f.name.count("_") == 2]
    lines = ["| run | result | step s (median after the first) | tokens/s | torch peak allocated GiB | planned GiB | "
             "reserved GiB | nvidia-smi peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        result = (f"trained {r['steps']} steps" if r["steps"] >= wanted_steps and r["rc"] == "0"
                  else "out of memory" if r["oom"] else f"exit {r['rc']} after {r['steps']} steps")
        rate = r["length"] / r["step_s"] if r["step_s"] else None
        cells = [_cell(r["step_s"], ".1f"), _cell(rate, ",.0f")] + [_cell(r[k], ".1f") for k in
                                                                  ("allocated", "planned", "reserved", "smi")]
        lines.append(f"| {r['side']} {r['length']:,} | {result} | " + " | ".join(cells) + " |")
    longest = {side: max((r["length"] for r in rows if r["side"] == side and r["steps"] >= wanted_steps
                          and r["rc"] == "0"), default=None) for side in ("ours", "stock")}
    said = ", ".join(f"{side} {_cell(n, ',')}" for side, n in longest.items())
    if all(longest.values()):
        said += f" ({longest['ours'] / longest['stock']:.2f}x stock's length, among the lengths tried)"
    return "\n".join(lines) + f"\n\nLongest length that trained {wanted_steps} steps: {said}.\n"


if __name__ == "__main__":
    work_dir, out_file = Path(sys.argv[1]), Path(sys.argv[2])
    out_file.write_text(report(work_dir, int(sys.argv[3]) if len(sys.argv) > 3 else 3))
    print(out_file.read_text())
