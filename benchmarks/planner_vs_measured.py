"""Predicted (hf_zero3.plan.memory) vs measured memory for every GPU run committed here: peak GPU memory
(`torch.cuda.max_memory_allocated`, max over ranks and steps) for the `hf-zero3 bench` runs and the memory
probes, and host RAM per node for the probes (MemTotal - MemAvailable, peak minus start; memory_probe.py).
Written to benchmarks/results/planner_vs_measured.md:  python benchmarks/planner_vs_measured.py
(`--check` exits 1 when the committed file differs from what the records give; a unit test runs the same check).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from hf_zero3.config.presets import RECIPE_CONFIGS, STANDALONE_CONFIGS
from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.memory import plan as plan_of
from hf_zero3.plan.shapes import ModelShape, load_shape
from hf_zero3.plan.types import Hardware, Training, describe
from hf_zero3.units import current_names

HERE = Path(__file__).resolve().parent
GiB = 1024**3
PROBES = "results/2026-11-30_memory-probe-8b"
VS_STOCK = "results/2026-11-30_8b-vs-stock/"
TUNED = "results/2026-11-30_8b-tuned/"
H200X2 = Hardware(nodes=1, gpus_per_node=2, gpu_mem=141 * 10**9, host_ram=None)
SEQ4096 = Training(seq_len=4096, micro_batch=1, grad_accum=4)
SCRATCH = Training(seq_len=4096, micro_batch=1, grad_accum=4, load_bytes=4)  # built from a config: fp32 at load
RECIPE_8B = RECIPE_CONFIGS["8b"].model_dump(exclude_unset=True)  # ZeRO-3 with 5e8-element buckets


def plan(shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec):
    """The planner's figures for a run measured here: a plain `Trainer` script's loss (the whole fp32 logits, or
    Liger's), not TRL's fused LM head that `hf-zero3 train` runs (`Training.trainer`)."""
    return plan_of(shape, hardware, dataclasses.replace(training, trainer="transformers"), spec)


def _spec(base: dict | ZeroSpec, **changes) -> ZeroSpec:
    fields = base.model_dump(exclude_unset=True) if isinstance(base, ZeroSpec) else base
    return ZeroSpec(**{**fields, "precision": "bf16", **changes})


BENCH_CASES = [
    # (benchmark jsonl, variant, hardware, training, spec, what ran)
    (VS_STOCK + "llama3-8b-zero3_auto_buckets_2xH200_2026-11-30.jsonl", "ours", H200X2, SEQ4096, _spec({}),
     "ZeRO-3, auto buckets"),
    (VS_STOCK + "llama3-8b-zero3_auto_buckets_2xH200_2026-11-30.jsonl", "stock", H200X2, SEQ4096,
     _spec({}, activation_checkpointing=True), "ZeRO-3 + checkpointing (stock template)"),
    (VS_STOCK + "llama3-8b-zero3_big_buckets_2xH200_2026-11-30.jsonl", "ours", H200X2, SEQ4096, _spec(RECIPE_8B),
     "ZeRO-3, 5e8 buckets"),
    (VS_STOCK + "llama3-8b_2xH200_2026-11-30.jsonl", "ours", H200X2, SEQ4096, _spec(RECIPE_8B),
     "ZeRO-3, 5e8 buckets (recipe 8b v1)"),
    (VS_STOCK + "llama3-8b_2xH200_2026-11-30.jsonl", "stock", H200X2, SEQ4096, _spec({}, activation_checkpointing=True),
     "ZeRO-3 + checkpointing (stock template)"),
    (VS_STOCK + "llama3-8b-zero2_2xH200_2026-11-30.jsonl", "ours", H200X2, SEQ4096, _spec({"stage": 2}), "ZeRO-2"),
    # Global batch 12, one machine: recipe 8b v2 and the hand-tuned stock baselines (hf_zero3/bench.py).
    (TUNED + "llama3-8b_2xH200_2026-11-30_tuned.jsonl", "ours", H200X2, Training(4096, 3, 2, liger=True), _spec(RECIPE_8B),
     "ZeRO-3 + Liger, micro 3 (recipe 8b v2)"),
    (TUNED + "llama3-8b_2xH200_2026-11-30_tuned.jsonl", "stock_tuned", H200X2, Training(4096, 2, 3), _spec({}),
     "ZeRO-3, micro 2 (stock template)"),
    (TUNED + "llama3-8b_2xH200_2026-11-30_tuned.jsonl", "zero2_tuned", H200X2, Training(4096, 1, 6), _spec({"stage": 2}),
     "ZeRO-2, micro 1 (stock template)"),
]
PROBE_CASES = [
    # (probe variant, training, spec, what ran): benchmarks/gpu_memory_probe.sh
    ("zero2", SCRATCH, _spec(STANDALONE_CONFIGS["zero2"]), "ZeRO-2"),
    ("zero2_ckpt", SCRATCH, _spec(STANDALONE_CONFIGS["zero2"], activation_checkpointing=True),
     "ZeRO-2 + checkpointing"),
    ("zero3", SCRATCH, _spec(RECIPE_8B), "ZeRO-3, 5e8 buckets (recipe 8b)"),
    ("zero3_ckpt", SCRATCH, _spec(RECIPE_8B, activation_checkpointing=True), "ZeRO-3 + checkpointing"),
    ("zero3_offload_opt", SCRATCH, _spec(STANDALONE_CONFIGS["zero3_offload_optimizer"]),
     "ZeRO-3 + optimizer offload (cpu)"),
    ("zero3_offload_all", SCRATCH, _spec(STANDALONE_CONFIGS["zero3_offload_all"]),
     "ZeRO-3 + optimizer and param offload (cpu)"),
    # Predicted before they ran, with the calibrated planner: shapes outside the calibration runs.
    ("zero3_seq6144", Training(6144, 1, 2, load_bytes=4), _spec(RECIPE_8B), "ZeRO-3, seq 6144 (after calibration)"),
    ("zero3_ckpt_micro2", Training(4096, 2, 2, load_bytes=4), _spec(RECIPE_8B, activation_checkpointing=True),
     "ZeRO-3 + checkpointing, micro batch 2 (after calibration)"),
]


# The seed-claims ladder on one H200 (gpu_compare_ladder.sh, GPUS=1): a 1.1B Llama (TinyLlama's shape), the stock
# zero3_auto template per rung (hf_zero3/ops/compare.py `ladder`), micro 4 at 1024 tokens, fp32 weights loaded.
LADDER = "results/2026-12-01_seed-claims-1gpu"
LADDER_SHAPE = ModelShape("1.1b", layers=22, hidden=2048, ffn=5632, heads=32, kv_heads=4, vocab=32000,
                          max_positions=2048)
LADDER_RUNGS = ["zero3", "zero3_ckpt", "zero3_ckpt_offload_opt", "zero3_ckpt_offload_all"]
H200X1 = Hardware(nodes=1, gpus_per_node=1, gpu_mem=141 * 10**9, host_ram=None)


def ladder_cases() -> list[tuple[str, ZeroSpec, float]]:
    """(rung, its spec in bf16, measured peak allocated GiB) for the ZeRO rungs of the 1 x H200 ladder."""
    from hf_zero3.ops.compare import ladder

    rungs = ladder(LADDER_RUNGS, on_gpu=True, nvme_path=None)
    return [(r.name, _spec(r.spec), current_names(json.loads((HERE / LADDER / "rungs" / f"{r.name}.json").read_text()))
             ["gpu_peak_allocated_gib"]) for r in rungs]


# LoRA (r 16, all-linear, dropout 0.05) on the 8B shape, 1 x H200, Liger, micro 4 x 4 (benchmarks/lora_bench.py): the
# runs that finished; the ds_config each ran is in the record.
LORA_RUNS = [("results/2026-12-03_lora-8b-h200", "lora"), ("results/2026-12-03_lora-8b-h200-rerun", "lora_zero3")]
FORMER_ZERO3_LORA_BYTES = 2 * (4096 + 4096 + 14336) + 2 * (6 * 4096 + 14336 + 7 * 16)
"""Per token and layer of the 8B, what a ZeRO-3 LoRA run of 2026-12-03 kept and a run no longer does (docs/lora.md):
the frozen layers' inputs DeepSpeed's own linear kept (45,056 B) and the fp32 adapter's copies (78,048 B); its
weights took 2 B more per adapter parameter. Added to the plan of those runs: the planner plans what a run does now."""


def lora_cases() -> list[tuple[str, Training, ZeroSpec, float]]:
    """(study/variant, training, spec, measured peak allocated GiB) of the LoRA runs."""
    from hf_zero3.config.convert import spec_from_ds_config
    from hf_zero3.plan.lora import adapter

    cases = []
    for study, variant in LORA_RUNS:
        rows = {r["variant"]: r for r in map(json.loads, (HERE / study / "lora_bench.jsonl").read_text().splitlines())}
        row, ds = rows[variant], rows[variant]["config"]["ds_config"]
        training = Training(4096, ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
                            liger=True, adapter=adapter(load_shape("8b"), 16, "all-linear", 0.05))
        cases.append((f"{Path(study).name}/{variant}", training, _spec(spec_from_ds_config(ds)[0]),
                      row["peak_allocated_gib"]))
    return cases


# Long sequences on one H100 80GB (benchmarks/gpu_long_seq_8b.sh): the Llama-3.2-3B shape at 131,072 to 294,912
# tokens, the planner's configuration and the stock side's, run by `hf-zero3 train` (TRL's fused LM head, Liger).
LONG_SEQ = ["results/2026-12-05_long-seq-3b-h100", "results/2026-12-05_long-seq-3b-h100-vs-stock/runs"]
H100X1 = Hardware(nodes=1, gpus_per_node=1, gpu_mem=79 * GiB, host_ram=125 * GiB)


def long_seq_cases() -> list[tuple[str, ModelShape, Training, ZeroSpec, float]]:
    """(run, shape, training, spec, measured peak allocated GiB) of each long-sequence run that logged a step, from
    its ds_config: activation checkpointing always, offloaded where the ds_config says so."""
    from hf_zero3.config.convert import spec_from_ds_config

    cases = []
    for run in sorted(p for folder in LONG_SEQ for p in (HERE / folder).glob("[0-9][0-9]_*_*")):
        logs = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()] \
            if (run / "train_log.jsonl").is_file() else []
        if not any("gpu_peak_allocated_gib" in r for r in logs):
            continue
        ds = json.loads((run / "ds_config.json").read_text())
        spec = _spec(spec_from_ds_config(ds)[0], activation_checkpointing=True, activation_offload=bool(
            ds.get("activation_checkpointing", {}).get("cpu_checkpointing")))
        study = HERE / "results" / run.relative_to(HERE / "results").parts[0]
        measured = max(r.get("gpu_peak_allocated_gib", 0) for r in logs)
        _, side, length = run.name.split("_")
        cases.append((f"{study.name}/{side}", load_shape(str(study / "model")), Training(int(length), liger=True),
                      spec, measured))
    return cases


# Checkpointed `hf-zero3 bench` runs, models built from a config (fp32 at load), seq 4096: the 7B on one H200 at global
# batch 16, and recipe 13b's proof on two; every variant whose resolved configuration (the report's "Resolved
# configurations") checkpoints. (report glob, model, GPUs)
CHECKPOINTED_BENCH = [("results/2026-12-01_ckpt-micro-7b-1gpu/*/p7/*_proof.md", "7b", 1),
                      ("results/2026-12-01_partial-ckpt-7b-1gpu/*/p7/*_proof.md", "7b", 1),
                      ("results/2026-11-30_recipes-proof-repeat/13b_*_proof.md", "13b", 2)]


def resolved_configs(report: Path) -> dict[str, dict]:
    """variant -> its resolved configuration: the JSON block under `### variant` of a bench report."""
    blocks = re.findall(r"^### (\S+)\n\n```json\n(.*?)\n```", report.read_text(), re.MULTILINE | re.DOTALL)
    return {name: json.loads(block) for name, block in blocks}


def checkpointed_bench_cases() -> list[tuple[str, str, int, Training, ZeroSpec, float]]:
    """(run, model, GPUs, training, spec, measured peak allocated GiB) of each checkpointed variant that logged a
    peak; run is the report's folder under results/ and the variant."""
    from hf_zero3.config.convert import spec_from_ds_config

    cases = []
    for pattern, model, gpus in CHECKPOINTED_BENCH:
        for report in sorted(HERE.glob(pattern)):
            rows = [current_names(json.loads(line)) for line in report.with_suffix(".jsonl").read_text().splitlines()]
            folder = "/".join(p for p in report.parent.relative_to(HERE / "results").parts if p != "p7")
            for variant, resolved in resolved_configs(report).items():
                args = resolved.get("training", {})
                peaks = [r["gpu_peak_allocated_gib"] for r in rows if r["variant"] == variant and
                         "gpu_peak_allocated_gib" in r]
                if not args.get("gradient_checkpointing") or not peaks:
                    continue
                spec = _spec(spec_from_ds_config(resolved["ds_config"])[0], activation_checkpointing=True,
                             checkpointed_layers=args.get("gradient_checkpointing_layers"))
                training = Training(resolved["data"]["block_size"], args["per_device_train_batch_size"],
                                    args["gradient_accumulation_steps"], liger=bool(args.get("use_liger_kernel")),
                                    load_bytes=4)
                cases.append((f"{folder}/{variant}", model, gpus, training, spec, max(peaks)))
    return cases


def bench_peak_gib(jsonl: str, variant: str) -> float:
    rows = [current_names(json.loads(line)) for line in (HERE / jsonl).read_text().splitlines()]
    return max(r["gpu_peak_allocated_gib"] for r in rows if r["variant"] == variant and "gpu_peak_allocated_gib" in r)


def probe(variant: str) -> dict:
    """The probe's ranks: GPU peak as the max over ranks; host RAM from local rank 0 (it samples the node)."""
    ranks = [json.loads(p.read_text()) for p in sorted((HERE / PROBES).glob(f"{variant}_rank*.json"))]
    host = next(r["host_node"] for r in ranks if "host_node" in r)
    return {"gpu_gib": max(r["max_memory_allocated_gib"] for r in ranks),
            "host_gib": host["peak_minus_baseline_gib"]}


def _row(run: str, what: str, predicted_bytes: int, measured_gib: float) -> str:
    predicted = predicted_bytes / GiB
    return f"| {run} | {what} | {predicted:.1f} | {measured_gib:.1f} | {(predicted - measured_gib) / measured_gib:+.1%} |"


def gpu_table() -> str:
    lines = ["| run | config | predicted GiB | measured GiB | error |", "|---|---|---|---|---|"]
    for jsonl, variant, hardware, training, spec, what in BENCH_CASES:
        predicted = plan(load_shape("8b"), hardware, training, spec).gpu_allocated_bytes
        lines.append(_row(f"{Path(jsonl).stem} ({variant})", what, predicted, bench_peak_gib(jsonl, variant)))
    for variant, training, spec, what in PROBE_CASES:
        predicted = plan(load_shape("8b"), H200X2, training, spec).gpu_allocated_bytes
        lines.append(_row(f"{Path(PROBES).name}/{variant}", what, predicted, probe(variant)["gpu_gib"]))
    for rung, spec, measured in ladder_cases():
        predicted = plan(LADDER_SHAPE, H200X1, Training(1024, 4, 1, load_bytes=4), spec).gpu_allocated_bytes
        lines.append(_row(f"{Path(LADDER).name}/{rung}", f"1.1B on 1 GPU: {describe(spec)} (stock template)", predicted,
                          measured))
    shape = load_shape("8b")
    for variant, training, spec, measured in lora_cases():
        predicted, former = plan(shape, H200X1, training, spec).gpu_allocated_bytes, ""
        if spec.stage == 3:  # run with DeepSpeed's own linear and peft's fp32 adapter
            predicted += training.tokens * shape.layers * FORMER_ZERO3_LORA_BYTES + 2 * training.adapter.params
            former = " (DeepSpeed's linear, fp32 adapter: their terms added)"
        lines.append(_row(variant, f"LoRA r 16 on 1 GPU: {describe(spec)} + Liger, micro "
                          f"{training.micro_batch}{former}", predicted, measured))
    for run, model, gpus, training, spec, measured in checkpointed_bench_cases():
        hardware = Hardware(nodes=1, gpus_per_node=gpus, gpu_mem=141 * GiB, host_ram=125 * GiB)
        predicted = plan(load_shape(model), hardware, training, spec).gpu_allocated_bytes
        lines.append(_row(run, f"{model.upper()} on {gpus} GPU{'s' if gpus > 1 else ''}: {describe(spec)}"
                          f"{' + Liger' if training.liger else ''}, micro {training.micro_batch}", predicted, measured))
    for run, shape, training, spec, measured in long_seq_cases():
        predicted = plan_of(shape, H100X1, training, spec).gpu_allocated_bytes  # TRL's fused LM head, as the run
        lines.append(_row(run, f"3B at {training.seq_len:,} tokens on 1 GPU: {describe(spec)} + Liger", predicted,
                          measured))
    return "\n".join(lines) + "\n"


def host_table() -> str:
    lines = ["| run | config | predicted GiB/node | measured GiB/node | error |", "|---|---|---|---|---|"]
    for variant, training, spec, what in PROBE_CASES:  # the probes saved nothing: no 16-bit gather on rank 0
        no_save = spec.model_copy(update={"gather_16bit_weights_on_save": False})
        predicted = plan(load_shape("8b"), H200X2, training, no_save).host_bytes
        lines.append(_row(f"{Path(PROBES).name}/{variant}", what, predicted, probe(variant)["host_gib"]))
    return "\n".join(lines) + "\n"


def table() -> str:
    return gpu_table() + "\n" + host_table()


OUTPUT = HERE / "results" / "planner_vs_measured.md"
HEADER = """# The planner against every GPU run committed here

Generated by `python benchmarks/planner_vs_measured.py` from the raw records in `benchmarks/results/`; do not edit.
Peak GPU memory: `torch.cuda.max_memory_allocated()`, max over ranks and steps, against `hf_zero3.plan.memory`'s
`gpu_allocated_bytes` for the same run. Host RAM (the memory probes): the node's `MemTotal - MemAvailable` at its
peak minus its value at start (page cache excluded), against the planner's `host_bytes`. What the probes showed:
[2026-11-30_memory-probe-8b/report.md](2026-11-30_memory-probe-8b/report.md).

"""


def render() -> str:
    return HEADER + table()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUTPUT.read_text() == render() else f"{OUTPUT} is stale: run python benchmarks/planner_vs_measured.py")
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
