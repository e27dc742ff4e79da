"""The planner's prediction for one offload run, and the run's measurements set against it.

  predict: python benchmarks/offload_plan_check.py predict --ds-config C --yaml Y --model CFG_DIR [--overrides S]
           --gpus N --gpu-mem 140GiB --host-ram 256GiB [--nvme-path DIR --nvme-free SIZE] --micro M --accum A
           --seq S [--from-scratch]            -> prediction JSON on stdout (every term, GPU/host/NVMe totals)
  compare: python benchmarks/offload_plan_check.py compare --pred P.json --log train_log.jsonl
           --host-samples host.tsv [--nvme-samples nvme.tsv] [--probe probe_rank0.json]
                                               -> a markdown table (measured vs planned, error, tolerance) on stdout

Measured GPU: the largest `gpu_peak_allocated_gb` of any rank in the run's JSONL log (or the probe's
max_memory_allocated); host: the node's peak MemTotal - MemAvailable minus its value before the launch (the sampler
the GPU script runs); NVMe: the largest size of the swap folder. Tolerances: GPU +-10%, host and
NVMe +-15%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GiB = 2**30
TOLERANCE = {"gpu": 0.10, "host": 0.15, "nvme": 0.15}


def predict(args) -> dict:
    from hf_zero3.argtypes import parse_size
    from hf_zero3.config.check import load_config
    from hf_zero3.config.convert import spec_from_ds_config
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.memory import Hardware, Training, plan
    from hf_zero3.plan.shapes import load_config_shape

    shape = load_config_shape(args.model, overrides=args.overrides)
    fields = spec_from_ds_config(load_config(args.ds_config))[0].model_dump(exclude_unset=True)
    spec = ZeroSpec(**{**fields, "precision": "bf16", "activation_checkpointing": args.checkpointing})
    size = lambda text: int(text) if text.isdigit() else parse_size(text)  # bytes or 140GiB
    nvme_free = size(args.nvme_free) if args.nvme_free else 0
    hardware = Hardware(1, args.gpus, size(args.gpu_mem), size(args.host_ram), args.nvme_path, nvme_free)
    p = plan(shape, hardware, Training(args.seq, args.micro, args.accum, "sdpa", 4 if args.from_scratch else None),
             spec)
    return {"model": {"params": shape.params, "layers": shape.layers, "hidden": shape.hidden},
            "option": p.label, "gpu_allocated_bytes": p.gpu_allocated_bytes, "gpu_bytes": p.gpu_bytes,
            "host_bytes": p.host_bytes, "nvme_bytes": p.nvme_bytes, "fits": p.fits, "problems": p.problems(),
            "terms": [{"where": t.where, "name": t.name, "bytes": t.bytes, "phase": t.phase, "formula": t.formula}
                      for t in p.terms]}


def _peak_column(path: str | None, column: int = 1) -> float | None:
    """Largest value of a whitespace-separated column (the samplers' files: time value)."""
    if not path or not Path(path).is_file():
        return None
    values = [float(line.split()[column]) for line in Path(path).read_text().splitlines()
              if len(line.split()) > column and line.split()[column].replace(".", "", 1).isdigit()]
    return max(values) if values else None


def measured(args) -> dict:
    found: dict = {}
    if args.log and Path(args.log).is_file():
        records = [json.loads(x) for x in Path(args.log).read_text().splitlines() if x.strip()]
        peaks = [v for r in records for k, v in r.items() if k.startswith("gpu_peak_allocated_gb") and
                 isinstance(v, (int, float))]
        if peaks:
            found["gpu"] = max(peaks) * GiB
        speed = [r for r in records if "tokens_per_s_per_gpu" in r]
        if speed:
            found["tokens_per_s_per_gpu"] = speed[-1]["tokens_per_s_per_gpu"]
            found["mfu"] = speed[-1].get("mfu")
            found["step_time_s"] = speed[-1].get("step_time_s")
    if args.probe and Path(args.probe).is_file():
        probe = json.loads(Path(args.probe).read_text())
        found["gpu"] = max(found.get("gpu", 0), probe["max_memory_allocated_gib"] * GiB)
    if args.host_samples and Path(args.host_samples).is_file():
        lines = Path(args.host_samples).read_text().split()
        baseline = float(lines[1]) if len(lines) > 1 else 0.0  # first sample: before the launch
        found["host"] = (_peak_column(args.host_samples) - baseline)
    nvme = _peak_column(args.nvme_samples)
    if nvme is not None:
        found["nvme"] = nvme
    return found


def compare(args) -> str:
    pred = json.loads(Path(args.pred).read_text())
    got = measured(args)
    planned = {"gpu": pred["gpu_allocated_bytes"], "host": pred["host_bytes"], "nvme": pred["nvme_bytes"]}
    rows = ["| memory | planned GiB | measured GiB | error | tolerance | within |", "|---|---|---|---|---|---|"]
    for where in ("gpu", "host", "nvme"):
        if where not in got or not planned[where]:
            rows.append(f"| {where} | {planned[where] / GiB:.1f} | not measured | | ±{TOLERANCE[where]:.0%} | |")
            continue
        error = planned[where] / got[where] - 1 if got[where] else float("inf")
        rows.append(f"| {where} | {planned[where] / GiB:.1f} | {got[where] / GiB:.1f} | {error:+.1%} | "
                    f"±{TOLERANCE[where]:.0%} | {'yes' if abs(error) <= TOLERANCE[where] else 'NO'} |")
    extra = {k: got[k] for k in ("tokens_per_s_per_gpu", "mfu", "step_time_s") if got.get(k) is not None}
    return "\n".join(rows) + ("\n\n" + json.dumps(extra) if extra else "") + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--ds-config", required=True)
    p.add_argument("--model", required=True, help="config folder")
    p.add_argument("--overrides")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-mem", required=True)
    p.add_argument("--host-ram", required=True)
    p.add_argument("--nvme-path")
    p.add_argument("--nvme-free")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--from-scratch", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("--pred", required=True)
    c.add_argument("--log")
    c.add_argument("--probe")
    c.add_argument("--host-samples")
    c.add_argument("--nvme-samples")
    args = parser.parse_args(argv)
    if args.verb == "predict":
        print(json.dumps(predict(args), indent=1))
    else:
        sys.stdout.write(compare(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
