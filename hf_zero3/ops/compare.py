"""`hf-zero3 compare`: the seed's claim ("up to 70% less VRAM, same convergence") measured on a ladder of
configurations that train the same model from the same initial weights on the same data, global batch and seed.

Rungs: plain DDP (the Trainer without DeepSpeed, under torchrun), ZeRO-1, ZeRO-2, ZeRO-3, then ZeRO-3 with
activation checkpointing, + optimizer offload, + parameter offload, + NVMe. Every ZeRO rung's ds_config is
`build_ds_config` of a spec derived from the `zero3_auto` preset (one owner of what a config means); `ddp_seed2` is
DDP again with another data-loader seed, the yardstick for bf16 rounding spread. Each rung is a real
`hf_zero3.train` run in its own process group, launched with torchrun (the same launcher for every rung); its
per-step log (loss, grad norm, memory, tokens/s: the project's callbacks) and a summary land in
`<out>/rungs/`, from which the report (Markdown + PNG) is rebuilt after every rung, so a ladder can be run in
pieces (`--rungs`) and a rung already recorded is skipped.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import shlex
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_zero3.config.build import build_ds_config, training_args_overrides
from hf_zero3.config.presets import STANDALONE_CONFIGS
from hf_zero3.config.spec import OptimizerOffload, ParamOffload, ZeroSpec
from hf_zero3.units import current_names

RUNGS = ("ddp", "ddp_seed2", "zero1", "zero2", "zero3", "zero3_ckpt", "zero3_ckpt_offload_opt",
         "zero3_ckpt_offload_all", "zero3_ckpt_nvme", "zero3_rc", "zero3_fp8")
"""zero3_rc: ZeRO-3 with each decoder layer compiled (`regional_compile`); zero3_fp8: that with FP8 matmuls (`fp8`).
Like every rung, their losses are judged against DDP's and the DDP seed spread."""
DEFAULT_RUNGS = tuple(r for r in RUNGS if r not in ("ddp_seed2", "zero3_rc", "zero3_fp8"))
REFERENCE = "ddp"


@dataclass(frozen=True)
class Rung:
    """One configuration of the ladder: its spec (None: plain DDP) and the data-loader seed offset."""

    name: str
    spec: ZeroSpec | None
    data_seed_offset: int = 0
    train: tuple[str, ...] = ()
    """Train overrides of the rung beyond its ds_config (compilation, FP8)."""


def ladder(names: list[str], *, on_gpu: bool, nvme_path: str | None) -> list[Rung]:
    """The named rungs, each a spec derived from the `zero3_auto` preset (precision follows TrainingArguments)."""
    base = STANDALONE_CONFIGS["zero3_auto"]
    cpu = OptimizerOffload(device="cpu", pin_memory=on_gpu)
    nvme = OptimizerOffload(device="nvme", nvme_path=nvme_path or "/nonexistent", pin_memory=on_gpu)
    specs: dict[str, ZeroSpec | None] = {
        "ddp": None, "ddp_seed2": None,
        "zero1": base.model_copy(update={"stage": 1}),
        "zero2": base.model_copy(update={"stage": 2}),
        "zero3": base,
        "zero3_ckpt": base.model_copy(update={"activation_checkpointing": True}),
        "zero3_ckpt_offload_opt": base.model_copy(update={"activation_checkpointing": True,
                                                          "offload_optimizer": cpu}),
        "zero3_ckpt_offload_all": base.model_copy(update={
            "activation_checkpointing": True, "offload_optimizer": cpu, "sub_group_size": 100_000_000,
            "offload_param": ParamOffload(**cpu.model_dump())}),
        "zero3_ckpt_nvme": base.model_copy(update={
            "activation_checkpointing": True, "offload_optimizer": nvme, "sub_group_size": 100_000_000,
            "offload_param": ParamOffload(**nvme.model_dump())}),
        "zero3_rc": base, "zero3_fp8": base,
    }
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"unknown rung(s) {unknown}: choose from {', '.join(RUNGS)}")
    # on CPU the compiler's tracing only: inductor's code generation takes minutes cold on a few cores
    compiled = ("--regional_compile", "true", "--regional_compile_backend", "inductor" if on_gpu else "aot_eager")
    train = {"zero3_rc": compiled, "zero3_fp8": (*compiled, "--fp8", "true")}
    return [Rung(n, ZeroSpec.model_validate(specs[n].model_dump()) if specs[n] else None,
                 1 if n == "ddp_seed2" else 0, train.get(n, ())) for n in names]


def ds_config_of(rung: Rung, *, on_gpu: bool) -> dict | None:
    """The rung's ds_config; on CPU an offloaded optimizer steps with torch's AdamW (DeepSpeedCPUAdam is a compiled
    op; torch's is also what the Trainer uses on the other rungs, so the CPU ladder compares like with like)."""
    if rung.spec is None:
        return None
    config = build_ds_config(rung.spec)
    if not on_gpu and "optimizer" in config:
        config["optimizer"]["params"]["torch_adam"] = True
    return config


def rung_overrides(rung: Rung, seed: int) -> list[str]:
    """Train overrides that make the rung what it says, whatever the recipe's YAML sets (checkpointing, DeepSpeed)."""
    extra = training_args_overrides(rung.spec) if rung.spec else {}
    ckpt = bool(extra.get("gradient_checkpointing"))
    out = ["--gradient_checkpointing", "true" if ckpt else "false"]
    if ckpt:
        out += ["--gradient_checkpointing_kwargs", json.dumps(extra["gradient_checkpointing_kwargs"])]
    if rung.spec is None:
        out += ["--deepspeed", "null"]
    if rung.data_seed_offset:
        out += ["--data_seed", str(seed + rung.data_seed_offset)]
    return out + list(rung.train)


def nvme_skip_reason(nvme_path: str | None) -> str | None:
    """Why the NVMe rung cannot run here (None: it can): DeepSpeed's async_io op needs libaio, and a folder."""
    if not nvme_path:
        return "no --nvme-path given (a folder on a local NVMe mount)"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return "DeepSpeed's async_io op is not buildable here (libaio-dev missing: apt-get install libaio-dev)"
    except Exception as e:  # noqa: BLE001 -- an op builder that cannot even be asked is a skip reason too
        return f"DeepSpeed's async_io op cannot be checked: {e}"
    return None


def initial_weights(values: dict[str, Any], work_dir: Path, seed: int) -> tuple[str, str]:
    """(model folder, sha256 of its weights) that every rung loads: pretrained weights as given, or, for a
    from-scratch recipe, the model made once from its config with `seed` in fp32 and saved under `work_dir`, in a
    folder named by the config and seed (so a later call with the same ones reuses it, and another never does)."""
    if values.get("model_name_or_path"):
        folder = Path(values["model_name_or_path"])
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(values["config_name"])
        if values.get("config_overrides"):
            config.update_from_string(values["config_overrides"])
        key = hashlib.sha256(f"{config.to_json_string()}{seed}".encode()).hexdigest()[:12]
        folder = work_dir / f"initial_model_{key}"
        if not (folder / "model.safetensors").exists() and not (folder / "model.safetensors.index.json").exists():
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

            # the runner's imports wait for a run: every `hf-zero3` parser reads RUNGS
            from hf_zero3.checkpoint.export import claim_staging, mark_staging, release_staging

            set_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            tmp = folder.with_name(folder.name + ".tmp")
            claim_staging(tmp)  # removed only if a killed earlier call of ours left it (its owner file says so)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            mark_staging(tmp)
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(values.get("tokenizer_name") or values["config_name"]).save_pretrained(tmp)
            tmp.rename(folder)
            release_staging(tmp)
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return str(folder), digest.hexdigest()


def summarize(records: list[dict], warmup: int) -> dict[str, Any]:
    """Peaks over the run, tokens/s median after warmup, the final held-out loss and perplexity."""
    steps = [r for r in records if "loss" in r]

    def peak(key):
        values = [r[key] for r in steps if r.get(key) is not None]
        return max(values) if values else None

    speeds = [r["tokens_per_s_per_gpu"] for r in steps if r["step"] > warmup and r.get("tokens_per_s_per_gpu")]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    return {"steps": len(steps), "final_loss": steps[-1]["loss"] if steps else None,
            "gpu_peak_allocated_gib": peak("gpu_peak_allocated_gib"), "gpu_peak_reserved_gib": peak("gpu_peak_reserved_gib"),
            "host_rss_gib": peak("host_rss_gib"), "tokens_per_s_per_gpu": statistics.median(speeds) if speeds else None,
            "eval_loss": evals[-1] if evals else None,
            "eval_perplexity": math.exp(min(evals[-1], 50.0)) if evals else None}


def deviation(records: list[dict], reference: list[dict], tail: float = 0.1) -> dict[str, float] | None:
    """|loss - reference loss| over the steps both logged: max, final, and of the mean over the last `tail`."""
    ours = {r["step"]: r["loss"] for r in records if "loss" in r}
    ref = {r["step"]: r["loss"] for r in reference if "loss" in r}
    common = sorted(set(ours) & set(ref))
    if not common:
        return None
    last = common[-max(1, int(len(common) * tail)):]
    return {"max": max(abs(ours[s] - ref[s]) for s in common), "final": abs(ours[common[-1]] - ref[common[-1]]),
            "tail_mean": abs(statistics.fmean(ours[s] for s in last) - statistics.fmean(ref[s] for s in last)),
            "steps": len(common)}


def run_rung(rung: Rung, *, yaml_path: Path, model_dir: str, init_sha: str, steps: int, warmup: int, gpus: int,
             seed: int, extra: list[str], rungs_dir: Path, work_dir: Path, on_gpu: bool, run_timeout: float,
             meta: dict, stop_after: int = 0) -> dict:
    """Train one rung and write `rungs/<name>.jsonl` (its per-step records) and `rungs/<name>.json` (summary).
    With `stop_after`, the rung runs the first `stop_after` steps of the `steps`-step schedule (learning rate and
    all as in a full rung, so its losses compare step by step) and has no held-out evaluation."""
    # the runner's imports wait for a run: every `hf-zero3` parser reads RUNGS
    from hf_zero3.ops.bench import follow_run, read_jsonl, scratch_run_dir, stop_run
    from hf_zero3.job.distributed import free_port

    run_dir = work_dir / rung.name
    scratch_run_dir(run_dir)
    overrides = ["--model_name_or_path", model_dir, "--config_name", "null", "--tokenizer_name", model_dir,
                 "--config_overrides", "null", "--max_steps", str(steps), "--logging_steps", "1",
                 "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none", "--output_dir", str(run_dir),
                 "--overwrite_output_dir", "true", "--save_final_model", "false", *extra, *rung_overrides(rung, seed)]
    config = ds_config_of(rung, on_gpu=on_gpu)
    if config is not None:
        config_path = work_dir / f"{rung.name}_ds_config.json"
        config_path.write_text(json.dumps(config, indent=2))
        overrides += ["--deepspeed", str(config_path)]
    cmd = ["torchrun", "--nproc_per_node", str(gpus), "--master_port", str(free_port()), "-m", "hf_zero3.train",
           str(yaml_path), *overrides]
    log_path = work_dir / f"{rung.name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = follow_run(proc, run_dir / "train_log.jsonl", steps, f"compare {rung.name}", run_timeout,
                           stop_at=stop_after if 0 < stop_after < steps else 0)
        finally:
            if proc.poll() is None:
                stop_run(proc)
    records = read_jsonl(run_dir / "train_log.jsonl")
    if 0 < stop_after < steps:  # the run is polled, so a step or two past N may have been logged before the stop
        records = [r for r in records if r.get("step", 0) <= stop_after]
    summary: dict[str, Any] = {"rung": rung.name, "command": shlex.join(cmd), "ds_config": config,
                               "init_sha256": init_sha, **meta, **summarize(records, warmup), "schedule_steps": steps}
    if code == 124:
        summary["error"] = f"exit 124: stopped by --run-timeout ({run_timeout:.0f} s) (log: {log_path})"
    elif code != 0:
        lines = log_path.read_text().strip().splitlines()
        tail = [line for line in lines if line.startswith("error: ")][-1:] or lines[-1:] or ["?"]
        summary["error"] = f"exit {code}: {tail[0][:200]} (log: {log_path})"
    rungs_dir.mkdir(parents=True, exist_ok=True)
    with (rungs_dir / f"{rung.name}.jsonl").open("w") as f:
        for record in records:
            f.write(json.dumps({"rung": rung.name, **record}) + "\n")
    (rungs_dir / f"{rung.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def record_skip(rungs_dir: Path, name: str, reason: str, meta: dict) -> None:
    rungs_dir.mkdir(parents=True, exist_ok=True)
    (rungs_dir / f"{name}.json").write_text(json.dumps({"rung": name, "skipped": reason, **meta}, indent=1) + "\n")


def load_results(rungs_dir: Path) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Every rung recorded in `rungs_dir`, in ladder order: summaries and per-step records."""
    # the runner's imports wait for a run: every `hf-zero3` parser reads RUNGS
    from hf_zero3.ops.bench import read_jsonl

    found = {p.stem: current_names(json.loads(p.read_text())) for p in rungs_dir.glob("*.json")}
    order = [n for n in RUNGS if n in found] + sorted(n for n in found if n not in RUNGS)
    return ({n: found[n] for n in order}, {n: read_jsonl(rungs_dir / f"{n}.jsonl") for n in order})


def _fmt(value, digits=2, suffix=""):
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _sci(value):
    return "—" if value is None else f"{value:.1e}"


def measured(summary: dict) -> bool:
    """A rung with figures to show: it ran and logged steps (a rung stopped partway shows its first steps)."""
    return "skipped" not in summary and ("error" not in summary or bool(summary.get("steps")))


def _max_steps(command: str) -> int | None:
    """The schedule length a rung was launched with (records from before `schedule_steps` was stored)."""
    words = shlex.split(command)[::-1]  # the last --max_steps wins, as in the Trainer's argument parser
    return int(words[words.index("--max_steps") - 1]) if "--max_steps" in words[1:] else None


def _within(records: list[dict], steps: set[int]) -> list[dict]:
    return [r for r in records if "loss" in r and r["step"] in steps]


def render_report(summaries: dict[str, dict], records: dict[str, list[dict]], label: str | None = None) -> str:
    """The Markdown report: memory and throughput against DDP, loss deviation against DDP and its seed spread
    (over the same steps, so a rung that ran fewer steps is held to the same yardstick)."""
    ran = {n: s for n, s in summaries.items() if measured(s)}
    first = next(iter(ran.values()), next(iter(summaries.values())))
    on_gpu = any(s.get("gpu_peak_allocated_gib") for s in ran.values())
    label = label or first.get("label", "compare")
    lines = _report_header(first, label, on_gpu)
    seed2 = records.get("ddp_seed2", []) if "ddp_seed2" in ran else []
    for name, s in summaries.items():
        lines.append(_rung_row(name, s, first, ran.get(REFERENCE), records, seed2, on_gpu))
    lines += _report_notes(ran, records, first)
    lines += ["", f"![loss curves and memory per rung]({label}.png)", "",
              "## Commands and resolved ds_configs", ""]
    for name, s in ran.items():
        lines += [f"### {name}", "", "```", s.get("command", "?"), "```", ""]
        if s.get("ds_config"):
            lines += ["```json", json.dumps(s["ds_config"], indent=1), "```", ""]
    return "\n".join(lines) + "\n"


def _report_header(first: dict, label: str, on_gpu: bool) -> list[str]:
    """The title, hardware, versions, model, data and memory's meaning, and the table's heading."""
    return [f"# Seed claims measured: {label} on {first.get('hardware_short', '?')} "
            f"({first.get('date', '?')})", "",
            f"Hardware: {first.get('hardware', '?')}  ",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in (first.get("versions") or {}).items()) + "  ",
            f"Model: {first.get('model', '?')}; initial weights sha256 {str(first.get('init_sha256', '?'))[:16]}… "
            "(the same file for every rung)  ",
            f"Data: {first.get('data', '?')}; sequence length {first.get('seq_len')}; global batch "
            f"{first.get('global_batch')} sequences; {first.get('steps')} steps; seed {first.get('seed')}  ",
            "Memory: " + ("peak GPU memory per rank (max over ranks), torch allocator" if on_gpu else
                          "**CPU run: no GPU memory exists; the figure is the peak host RSS per rank (max over "
                          "ranks)**, which says nothing about VRAM") + ".", "",
            "| rung | peak alloc GiB | peak reserved GiB | host RSS GiB | vs DDP memory | tokens/s/GPU | vs DDP "
            "speed | max abs Δloss | final abs Δloss | last-10% mean abs Δloss | DDP seed spread, same steps "
            "(last-10% mean) | held-out loss | held-out ppl |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def _rung_row(name: str, s: dict, first: dict, ref: dict | None, records: dict[str, list[dict]],
              seed2: list[dict], on_gpu: bool) -> str:
    """One rung's row: skipped or failed, else its memory and speed against DDP (`ref`), its loss deviation from
    DDP's and the seed spread over its own steps."""
    if "skipped" in s:
        return f"| {name} | skipped: {s['skipped']} | | | | | | | | | | | |"
    if not measured(s):
        return f"| {name} | failed: {s['error']} | | | | | | | | | | | |"
    base = records.get(REFERENCE, [])
    mem_key = "gpu_peak_allocated_gib" if on_gpu else "host_rss_gib"
    mem = (f"{100 * (s[mem_key] / ref[mem_key] - 1):+.0f}%" if ref and s.get(mem_key) and ref.get(mem_key)
           else "—")
    speed = (f"{s['tokens_per_s_per_gpu'] / ref['tokens_per_s_per_gpu']:.2f}x" if ref and s.get(
        "tokens_per_s_per_gpu") and ref.get("tokens_per_s_per_gpu") else "—")
    dev = deviation(records[name], base) if name != REFERENCE and base else None
    own_steps = {r["step"] for r in records[name] if "loss" in r}
    spread = deviation(_within(seed2, own_steps), base) if seed2 and name not in (REFERENCE, "ddp_seed2") else None
    schedule = s.get("schedule_steps") or _max_steps(s.get("command", ""))
    shown = name if s.get("steps") == first.get("steps") else f"{name} ({s.get('steps')} steps: Δloss over those)"
    if s.get("steps") and schedule and s["steps"] < schedule:
        how = f", then {s['error'].split(':')[0]}" if "error" in s else ""
        shown = f"{name} (first {s['steps']} of the {schedule}-step schedule{how}: Δloss over those)"
    return (f"| {shown} | {_fmt(s.get('gpu_peak_allocated_gib'))} | {_fmt(s.get('gpu_peak_reserved_gib'))} | "
            f"{_fmt(s.get('host_rss_gib'))} | {mem} | {_fmt(s.get('tokens_per_s_per_gpu'), 0)} | {speed} | "
            f"{_sci(dev and dev['max'])} | {_sci(dev and dev['final'])} | "
            f"{_sci(dev and dev['tail_mean'])} | {_sci(spread and spread['tail_mean'])} | "
            f"{_fmt(s.get('eval_loss'), 4)} | "
            f"{_fmt(s.get('eval_perplexity'), 3)} |")


def _report_notes(ran: dict[str, dict], records: dict[str, list[dict]], first: dict) -> list[str]:
    """Under the table: what Δloss means, the rungs against zero3, mismatched weights, precision, DDP's spread."""
    base = records.get(REFERENCE, [])
    lines = ["", "Δloss: the rung's training loss minus DDP's at the same step (same weights, data, batch, seed). "
             "DDP seed spread: ddp_seed2's (DDP, another data-loader seed) over the rung's own steps. exit 124: the "
             "rung was stopped by --run-timeout; its figures cover the steps it logged."]
    zero3 = records.get("zero3", []) if "zero3" in ran else []
    against = {n: deviation(records[n], zero3) for n in ran if n.startswith("zero3_") and zero3}
    if against := {n: d for n, d in against.items() if d}:
        lines += ["Against zero3 (the same DeepSpeed bf16 path, so only what checkpointing and offload change): " +
                  "; ".join(f"{n} max {_sci(d['max'])}, final {_sci(d['final'])} over {d['steps']} steps"
                            for n, d in against.items()) + "."]
    if len({s.get("init_sha256") for s in ran.values()}) > 1:
        lines += ["**Warning: the rungs did not all start from the same initial weights (sha256 differs); their "
                  "losses are not comparable step by step.**"]
    given = first.get("overrides") or []
    if "--bf16=true" in given or any(a == "--bf16" and b == "true" for a, b in zip(given, given[1:])):
        lines += ["Precision: DDP is the Trainer's bf16 autocast over fp32 weights, gradients and Adam states; the ZeRO "
                  "rungs run DeepSpeed's bf16 (bf16 weights and gradients, fp32 master weights and Adam states in the "
                  "optimizer). Part of every ZeRO rung's memory saving is that difference, not the partitioning; "
                  "and the two round differently, hence the ddp_seed2 spread as the yardstick."]
    if "ddp_seed2" in ran and base:
        spread = deviation(records["ddp_seed2"], base)
        lines += [f"DDP spread (ddp_seed2: DDP with another data-loader seed): max {_sci(spread['max'])}, "
                  f"final {_sci(spread['final'])}, last-10% mean {_sci(spread['tail_mean'])}. A ZeRO rung "
                  "within this spread converges like DDP as far as this run can tell."]
    return lines


def plot(path: Path, summaries: dict[str, dict], records: dict[str, list[dict]]) -> bool:
    """Loss curves overlaid (top), each rung's loss minus DDP's (middle), peak memory per rung (bottom); False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ran = [n for n, s in summaries.items() if measured(s)]
    on_gpu = any(summaries[n].get("gpu_peak_allocated_gib") for n in ran)
    key = "gpu_peak_allocated_gib" if on_gpu else "host_rss_gib"
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 11))
    base = {r["step"]: r["loss"] for r in records.get(REFERENCE, []) if "loss" in r}
    for index, name in enumerate(ran):
        steps = [r for r in records[name] if "loss" in r]
        reference = name == REFERENCE  # drawn on top, dashed: rungs that match it would hide it otherwise
        top.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="black" if reference else f"C{index}",
                 label=name, alpha=0.9 if reference else 0.7, linewidth=1.5 if reference else 1,
                 linestyle="--" if reference else "-", zorder=3 if reference else 2)
        if base and name != REFERENCE:  # each rung's loss minus DDP's at the same step
            common = [r for r in steps if r["step"] in base]
            middle.plot([r["step"] for r in common], [r["loss"] - base[r["step"]] for r in common],
                        color=f"C{index}", label=name, alpha=0.7, linewidth=1)
    top.set_xlabel("step")
    middle.axhline(0, color="black", linestyle="--", linewidth=1)
    middle.set_xlabel("step")
    middle.set_ylabel(f"loss - {REFERENCE} loss")
    middle.grid(alpha=0.3)
    top.set_ylabel("training loss")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    colors = ["black" if n == REFERENCE else f"C{i}" for i, n in enumerate(ran)]
    if on_gpu:  # allocated (solid) and reserved (hatched) side by side
        bottom.bar([i - 0.2 for i in range(len(ran))], [summaries[n].get(key) or 0 for n in ran], 0.4, color=colors,
                   label="peak allocated")
        bottom.bar([i + 0.2 for i in range(len(ran))], [summaries[n].get("gpu_peak_reserved_gib") or 0 for n in ran],
                   0.4, color=colors, alpha=0.4, hatch="//", label="peak reserved")
        bottom.legend(fontsize=8)
    else:
        bottom.bar(range(len(ran)), [summaries[n].get(key) or 0 for n in ran], color=colors)
    bottom.set_xticks(range(len(ran)), ran, rotation=20, fontsize=8)
    bottom.set_ylabel("peak GPU memory per rank (GiB)" if on_gpu else "peak host RSS per rank (GiB; CPU run, not VRAM)")
    bottom.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(out_dir: Path, label: str) -> Path:
    """Rebuild `<out>/<label>.md` and `.png` from every rung recorded in `<out>/rungs/`."""
    summaries, records = load_results(out_dir / "rungs")
    report = out_dir / f"{label}.md"
    report.write_text(render_report(summaries, records, label))
    plot(report.with_suffix(".png"), summaries, records)
    return report


def run_compare(yaml_path: Path, values: dict[str, Any], names: list[str], *, steps: int, warmup: int, gpus: int,
                out_dir: Path, work_dir: Path, extra: list[str], label: str, meta: dict, nvme_path: str | None,
                run_timeout: float = 0, redo: bool = False, nvme_steps: int | None = None,
                stop_after: int = 0) -> tuple[Path, dict[str, str]]:
    """Run the named rungs (skipping those already in `<out>/rungs/` unless `redo`), then write the report.
    The NVMe rung runs `nvme_steps` (default `steps`): each of its steps reads and writes every offloaded byte on the
    disk. `stop_after` (> 0) stops every rung of this call after that many steps of the `steps`-step schedule.
    Returns the report and the rungs that failed (name -> error)."""
    # the runner's imports wait for a run: every `hf-zero3` parser reads RUNGS
    from hf_zero3.ops.bench import hardware_label, versions
    from hf_zero3.job.distributed import cuda_available


    on_gpu = cuda_available()
    rungs = ladder(names, on_gpu=on_gpu, nvme_path=nvme_path)
    rungs_dir = out_dir / "rungs"
    short_hw, long_hw = hardware_label()
    seed = int(values.get("seed", 42))
    meta = {"label": label, "date": datetime.date.today().isoformat(), "hardware": long_hw, "hardware_short": short_hw,
            "versions": versions(), "steps": steps, "seed": seed, **meta}
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir, init_sha = initial_weights(values, work_dir, seed)
    failed: dict[str, str] = {}
    for rung in rungs:
        if not redo and (rungs_dir / f"{rung.name}.json").exists():
            print(f"compare: {rung.name} already recorded in {rungs_dir}: skipped (--redo runs it again)", flush=True)
            continue
        if rung.name.endswith("nvme") and (reason := nvme_skip_reason(nvme_path)):
            record_skip(rungs_dir, rung.name, reason, meta)
            print(f"compare: {rung.name} skipped: {reason}", flush=True)
            continue
        rung_steps = (nvme_steps or steps) if rung.name.endswith("nvme") else steps
        summary = run_rung(rung, yaml_path=yaml_path, model_dir=model_dir, init_sha=init_sha, steps=rung_steps,
                           warmup=warmup, gpus=gpus, seed=seed, extra=extra, rungs_dir=rungs_dir, work_dir=work_dir,
                           on_gpu=on_gpu, run_timeout=run_timeout, meta=meta, stop_after=stop_after)
        if "error" in summary:
            failed[rung.name] = summary["error"]
        write_report(out_dir, label)
    return write_report(out_dir, label), failed
