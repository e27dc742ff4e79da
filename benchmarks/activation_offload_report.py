"""The tables of gpu_activation_offload.sh's results: `python benchmarks/activation_offload_report.py OUT/8b [8b]`.

Reads <mode>_rank<R>.jsonl (activation_offload_bench.py) and prints, per sequence length, checkpointing only and
checkpointing + offload side by side (memory: the larger rank; speed: rank 0), then the longest sequence each fit.
With a model name (`hf_zero3.plan.shapes.load_shape`), also the planner's figures beside the measured ones, for the
bench's setup: recipe 8b's ZeRO-3 config, bf16, micro batch 1, checkpointing, Liger as the run had it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = ("checkpointing", "offload")
GiB = 1024**3


def load(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("*_rank*.jsonl")) for line in path.read_text().splitlines()]


def measures(records: list[dict]) -> dict[tuple[int, str], dict]:
    """(seq, mode) -> rank 0's record with each memory figure the largest over ranks."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        if r.get("event") == "measure":
            groups.setdefault((r["seq"], r["mode"]), []).append(r)
    out = {}
    for key, group in groups.items():
        base = min(group, key=lambda r: r["rank"])
        out[key] = {**base, **{k: max(r[k] for r in group) for k in base if k.endswith("_gib")}}
    return out


def longest(records: list[dict]) -> dict[str, tuple[int | None, int | None, float | None]]:
    """mode -> (longest length that fit, first length that ran out of memory, the cap in GiB)."""
    result = {}
    for mode in MODES:
        mine = [r for r in records if r["mode"] == mode and r["rank"] == 0]
        fits = [r["seq"] for r in mine if r.get("event") == "fits"]
        ooms = [r["seq"] for r in records if r["mode"] == mode and r.get("event") == "oom"]
        caps = [r["cap_gib"] for r in mine if "cap_gib" in r]
        result[mode] = (max(fits) if fits else None, min(ooms) if ooms else None, caps[0] if caps else None)
    return result


def render(folder: Path) -> str:
    records = load(folder)
    rows = measures(records)
    lines = [("| seq | mode | tokens/s/GPU | step s | decoder leaves on GPU (GiB) | held after forward (GiB) | "
             "fwd+bwd peak above rest (GiB) | peak allocated (GiB) | peak reserved (GiB) | moved to host (GiB) | "
             "pinned host (GiB) |"), "|" + "---|" * 11]
    for seq in sorted({s for s, _ in rows}):
        for mode in MODES:
            r = rows.get((seq, mode))
            if r:
                lines.append(f"| {seq} | {mode} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_time_s']:.3f} | "
                             f"{r['decoder_held_gib']:.2f} | {r['held_after_forward_gib']:.2f} | "
                             f"{r['fwd_bwd_above_rest_gib']:.2f} | {r['peak_allocated_gib']:.2f} | "
                             f"{r['peak_reserved_gib']:.2f} | {r['offloaded_gib']:.2f} | {r['pinned_host_gib']:.2f} |")
        a, b = rows.get((seq, "checkpointing")), rows.get((seq, "offload"))
        if a and b and a["decoder_held_gib"] > 0:
            lines.append(f"| {seq} | **offload vs not** | {b['tokens_per_s_per_gpu'] / a['tokens_per_s_per_gpu'] - 1:+.1%} "
                         f"| | {1 - b['decoder_held_gib'] / a['decoder_held_gib']:.1%} less | "
                         f"{1 - b['held_after_forward_gib'] / a['held_after_forward_gib']:.1%} less | "
                         f"{1 - b['fwd_bwd_above_rest_gib'] / a['fwd_bwd_above_rest_gib']:.1%} less | "
                         f"{a['peak_allocated_gib'] - b['peak_allocated_gib']:+.2f} GiB less | | | |")
    lines.append("")
    for mode, (fit, oom, cap) in longest(records).items():
        lines.append(f"- {mode}: longest sequence that fit one step: {fit or 'none tried or none fit'}; first out of "
                     f"memory: {oom or 'none reached'}" + (f" (GPU capped at {cap:.1f} GiB)" if cap else ""))
    return "\n".join(lines)


def planner_table(folder: Path, model: str) -> str:
    """Per measured (seq, mode), rank 0: the planner's peak allocated, bytes moved and pinned host per GPU."""
    from hf_zero3.config.presets import RECIPE_CONFIGS
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.memory import plan
    from hf_zero3.plan.shapes import load_shape
    from hf_zero3.plan.types import Hardware, Training

    records = [r for r in load(folder) if r["rank"] == 0]
    ready = next(r for r in records if r.get("event") == "ready")
    world, liger, shape = ready["world"], ready["liger"], load_shape(model)
    hardware = Hardware(nodes=1, gpus_per_node=world, gpu_mem=141 * 10**9, host_ram=None)
    base = {**RECIPE_CONFIGS["8b"].model_dump(exclude_unset=True), "precision": "bf16", "activation_checkpointing": True}

    def planned(seq: int, offload: bool) -> dict[str, float]:
        p = plan(shape, hardware, Training(seq, liger=liger), ZeroSpec(**base, activation_offload=offload))
        terms = {(t.where, t.name): t.bytes / GiB for t in p.terms}
        return {"peak": p.gpu_allocated_bytes / GiB, "pinned": terms.get(("host", "activations offloaded (pinned)"), 0) / world,
                "inputs": next(v for (w, n), v in terms.items() if w == "gpu" and n.startswith("activations: checkpointed"))}

    lines = [("| seq | mode | peak allocated: planned / measured (GiB) | error | moved to host: planned / measured (GiB) | "
              "pinned host: planned / measured (GiB) |"), "|" + "---|" * 6]
    for r in sorted((r for r in records if r.get("event") in ("measure", "fits")), key=lambda r: (r["seq"], r["mode"])):
        if r.get("event") == "fits" and any(m.get("event") == "measure" and m["seq"] == r["seq"] and m["mode"] == r["mode"]
                                            for m in records):
            continue
        offload = r["mode"] == "offload"
        p, moved = planned(r["seq"], offload), planned(r["seq"], False)["inputs"] if offload else 0.0
        lines.append(f"| {r['seq']} | {r['mode']}{'' if r['event'] == 'measure' else ' (search, 1 step)'} | "
                     f"{p['peak']:.2f} / {r['peak_allocated_gib']:.2f} | {p['peak'] / r['peak_allocated_gib'] - 1:+.1%} | "
                     f"{moved:.3f} / {r['offloaded_gib']:.3f} | {p['pinned']:.2f} / {r['pinned_host_gib']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(Path(sys.argv[1])))
    if len(sys.argv) > 2:
        print("\nPlanner (hf_zero3.plan.memory) beside the measurement, rank 0:\n")
        print(planner_table(Path(sys.argv[1]), sys.argv[2]))
