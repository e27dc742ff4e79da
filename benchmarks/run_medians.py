"""One table for one machine measured in several calls: each `hf-zero3 bench` call writes its own report, but ratios
hold across the calls made on one warm machine, so the planner's speed table cites the table of all of them.

Reads the calls' bench JSONL files, summarizes each run as the bench does (`hf_zero3.ops.bench.summarize`: medians
after the warm-up steps), then each config over all its runs on the machine (`aggregate`), and prints a markdown table
in the bench report's format (config, median tokens/s/GPU, ..., runs: min-max).

Usage: python3 benchmarks/run_medians.py --warmup 2 [--rename ours=ck8@FILE] CALL1.jsonl CALL2.jsonl ...
(`--rename OLD=NEW@FILE`: a config's name in one file, e.g. the bench's "ours" when it ran different things per call.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_zero3.ops.bench import aggregate, summarize


def runs_by_config(paths: list[Path], warmup: int, rename: dict[tuple[str, str], str]) -> dict[str, list[dict]]:
    """config -> the summaries of its runs, in file order."""
    out: dict[str, list[dict]] = {}
    for path in paths:
        records: dict[tuple[str, int], list[dict]] = {}
        for line in path.read_text().splitlines():
            r = json.loads(line)
            records.setdefault((r["variant"], r["repeat"]), []).append(r)
        for (variant, _), rows in records.items():
            name = rename.get((variant, path.name), variant)
            out.setdefault(name, []).append(summarize(rows, warmup))
    return out


def table(by_config: dict[str, list[dict]]) -> str:
    lines = ["| config | tokens/s/GPU | MFU | peak alloc GiB | peak reserved GiB | step s | runs: min-max tokens/s/GPU |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in by_config.items():
        s = aggregate(runs)
        tps = sorted(r["tokens_per_s_per_gpu"] for r in runs if r.get("tokens_per_s_per_gpu"))
        lines.append(f"| {name} | {s['tokens_per_s_per_gpu']:.0f} | {s['mfu']:.1%} | {s['gpu_peak_allocated_gb']:.2f} | "
                     f"{s['gpu_peak_reserved_gb']:.2f} | {s['step_time_s']:.3f} | "
                     f"{len(tps)}: {tps[0]:.0f}-{tps[-1]:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", type=Path)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--rename", action="append", default=[], help="OLD=NEW@FILE (FILE: the JSONL's name)")
    args = ap.parse_args()
    rename = {}
    for item in args.rename:
        old, rest = item.split("=", 1)
        new, file = rest.split("@", 1)
        rename[(old, file)] = new
    print(table(runs_by_config(args.jsonl, args.warmup, rename)))


if __name__ == "__main__":
    main()
