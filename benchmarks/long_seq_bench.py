"""The two halves of `gpu_long_seq_8b.sh` that are not shell:
- stock-config: the ds_config of the stock side at a length: from the planner's options at that length
  (`hf-zero3 plan --json`), the first that fits with ZeRO-3 and whole activation checkpointing and without what a
  stock script cannot switch on (activation offload, checkpointing some layers only); its offload put into the
  stock ZeRO-3 template's section (ds_configs/zero3.json) of the planner's ds_config, whose activation offload
  block is dropped;
- report: per run (side:length) whether it trained its steps or ran out of memory, its step time, its memory
  against the plan, and the longest length each side trained at;
- lengths: what the planner says fits at each length, ours and the stock side's, without a GPU (the table of
  docs/long-sequences.md).
Usage:  python3 benchmarks/long_seq_bench.py stock-config PLAN.json DS_CONFIG.json (rewritten in place)
        python3 benchmarks/long_seq_bench.py report WORK_DIR OUT.md [STEPS]   (the script runs it after every run)
        python3 benchmarks/long_seq_bench.py lengths MODEL L [L ...] -- PLAN_ARGS   (e.g. 8b 196608 212992 --
        --hardware h200x1 --liger)
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

GiB = 1024**3


def stock_option(plan: dict) -> dict | None:
    """The least-offload option a stock script can set that fits (the planner lists its options by offload); when
    none is planned to fit, the one that needs the least GPU memory of those whose host RAM fits (the plan errs
    high: the run says whether it fits)."""
    settable = [o for o in plan["options"] if o["stage"] == 3 and o["checkpointing"] and not o["activation_offload"]
                and "(first" not in o["option"]]
    fitting = [o for o in settable if o["fits"]]
    if fitting or not settable:
        return fitting[0] if fitting else None
    return min(settable, key=lambda o: (any("host" in p for p in o["problems"]), o["gpu_bytes"]))


STOCK_TEMPLATE = Path(__file__).resolve().parents[1] / "ds_configs" / "zero3.json"


def stock_config(plan: dict, ds_config: dict, template: dict) -> dict | None:
    """`ds_config` without activation offload, its ZeRO section the stock template's (`template`: DeepSpeed's and
    HF's defaults, not the planner's buckets and persistence) with the offload of `stock_option`; None without an
    option."""
    option = stock_option(plan)
    if option is None:
        return None
    config = {k: v for k, v in ds_config.items() if k != "activation_checkpointing"}
    zero = {**template["zero_optimization"], "stage": option["stage"]}
    if option["offload_optimizer"] != "none":
        zero["offload_optimizer"] = {"device": option["offload_optimizer"],
                                     "pin_memory": option["offload_optimizer_pin_memory"],
                                     **({"ratio": option["offload_optimizer_ratio"]}
                                        if option["offload_optimizer_ratio"] < 1 else {})}
    if option["offload_param"] != "none":
        zero["offload_param"] = {"device": option["offload_param"], "pin_memory": True}
    return {**config, "zero_optimization": zero}


def planned_lengths(model: str, lengths: list[int], plan_args: list[str]) -> str:
    """`hf-zero3 plan --json` at each length: the option ours chooses and the stock side's, or "-" where none fits."""
    lines = ["| tokens | stock script | this plan |", "|---|---|---|"]
    for length in lengths:
        plan = json.loads(subprocess.run([sys.executable, "-m", "hf_zero3", "plan", "--model", model, "--seq-len",
                                          str(length), "--micro-batch", "1", "--json", *plan_args],
                                         capture_output=True, text=True, check=False).stdout)
        stock = stock_option(plan)
        ours = plan["choice"]["option"] if plan["choice"] else "-"
        lines.append(f"| {length:,} | {stock['option'] if stock and stock['fits'] else '-'} | {ours} |")
    return "\n".join(lines) + "\n"


def run_row(folder: Path) -> dict:
    """One run's facts from its folder, runs/NN_side_length/: rc.txt, plan.txt, train_log.jsonl, stdout.log and
    gpu_mib.txt, as the script leaves them."""
    _, side, length = folder.name.split("_")
    read = lambda name: (folder / name).read_text() if (folder / name).is_file() else ""
    logs = [json.loads(line) for line in read("train_log.jsonl").splitlines() if line.strip()]
    steps = [r for r in logs if "step_time_s" in r]
    planned = re.search(r"max_memory_allocated predicted: ([\d.]+) GB", read("plan.txt"))
    planned = float(planned.group(1)) * 1e9 / GiB if planned and (folder / "ds_config.json").is_file() else None
    if side == "stock" and read("plan.json"):  # the stock option's plan, not ours'
        option = stock_option(json.loads(read("plan.json")))
        planned = option["gpu_allocated_bytes"] / GiB if option else None
    smi = [int(x) for x in read("gpu_mib.txt").split() if x.isdigit()]
    return {"side": side, "length": int(length), "rc": read("rc.txt").strip() or "?",
            "oom": bool(re.search(r"OutOfMemoryError|CUDA out of memory", read("stdout.log"))), "steps": len(steps),
            "step_s": statistics.median(r["step_time_s"] for r in steps[1:]) if len(steps) > 1 else None,
            "allocated": max((r.get("gpu_peak_allocated_gib", 0) for r in steps), default=None),
            "reserved": max((r.get("gpu_peak_reserved_gib", 0) for r in steps), default=None),
            "planned": planned,
            "smi": max(smi) / 1024 if smi else None}


def _cell(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def _result(r: dict, wanted_steps: int) -> str:
    """A run's outcome: its steps trained count whatever ended it after them (a time limit while shutting down)."""
    if r["steps"] >= wanted_steps:
        return f"trained {r['steps']} steps" + ("" if r["rc"] == "0" else f" (then exit {r['rc']})")
    if r["oom"]:
        return "out of memory"
    if r["rc"] == "no plan":
        return "planned not to fit"
    if r["rc"] == "?":  # no rc.txt: the script itself was stopped during the run
        return f"stopped from outside after {r['steps']} steps"
    return f"exit {r['rc']} after {r['steps']} steps"


def report(work: Path, wanted_steps: int) -> str:
    rows = [run_row(f) for f in sorted((work / "runs").iterdir()) if f.is_dir() and f.name.count("_") == 2]
    lines = ["| run | result | step s (median after the first) | tokens/s | torch peak allocated GiB | planned GiB | "
             "reserved GiB | nvidia-smi peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        result = _result(r, wanted_steps)
        rate = r["length"] / r["step_s"] if r["step_s"] else None
        cells = [_cell(r["step_s"], ".1f"), _cell(rate, ",.0f")] + [_cell(r[k], ".1f") for k in
                                                                  ("allocated", "planned", "reserved", "smi")]
        lines.append(f"| {r['side']} {r['length']:,} | {result} | " + " | ".join(cells) + " |")
    longest = {side: max((r["length"] for r in rows if r["side"] == side and r["steps"] >= wanted_steps),
                         default=None) for side in ("ours", "stock")}
    said = ", ".join(f"{side} {_cell(n, ',')}" for side, n in longest.items())
    if all(longest.values()):
        said += f" ({longest['ours'] / longest['stock']:.2f}x stock's length, among the lengths tried)"
    return "\n".join(lines) + f"\n\nLongest length that trained {wanted_steps} steps: {said}.\n"


if __name__ == "__main__":
    if sys.argv[1] == "lengths":
        cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
        print(planned_lengths(sys.argv[2], [int(n) for n in sys.argv[3:cut]], sys.argv[cut + 1:]), end="")
    elif sys.argv[1] == "stock-config":
        plan_json, ds_path = json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
        stock = stock_config(plan_json, json.loads(ds_path.read_text()), json.loads(STOCK_TEMPLATE.read_text()))
        if stock is None:
            sys.exit("stock-config: the plan has no ZeRO-3 option with checkpointing")
        ds_path.write_text(json.dumps(stock, indent=2))
        option = stock_option(plan_json)
        print(f"stock: {option['option']}" + ("" if option["fits"] else f" (planned not to fit: {option['problems']})"))
    else:
        work_dir, out_file = Path(sys.argv[2]), Path(sys.argv[3])
        out_file.write_text(report(work_dir, int(sys.argv[4]) if len(sys.argv) > 4 else 3))
        print(out_file.read_text())
