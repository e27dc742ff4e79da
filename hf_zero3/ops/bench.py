"""`hf-zero3 bench`: our recipe and the stock baselines, one after another, on the same model, sequence
length, global batch and GPUs; one report with tokens/s, TFLOP/s, MFU and memory side by side.

Each variant is a real `hf_zero3.train` run in its own process group (fresh CUDA context, fresh peak
memory), launched as a user would launch it: DeepSpeed's launcher for ZeRO, torchrun for FSDP2.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOCK_ZERO3 = {
    # transformers' documented ZeRO-3 template ("auto" everywhere the Trainer fills), DeepSpeed's AdamW and
    # WarmupLR, no offload; `stock_offload` is the same template with its CPU offload of params and optimizer.
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
STOCK_ZERO2 = {
    # transformers' documented ZeRO-2 template without its CPU offload, optimizer and scheduler blocks.
    "fp16": STOCK_ZERO3["fp16"], "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
TUNED_MICRO_BATCH = {"stock_tuned": 2, "zero2_tuned": 1, "fsdp2_tuned": 2}
"""What a user tuning stock HF by hand runs (the `*_tuned` baselines): the stock template, the Trainer's default
optimizer (fused torch AdamW), no DeepSpeed scheduler, no activation checkpointing, no Liger, and the largest
micro batch that fits Llama-3-8B at sequence 4096 on 2 x H200 without checkpointing (measured: stock ZeRO-3 2,
FSDP2 2 at 106.9 GiB; ZeRO-2 1 at 100.5 GiB, 2 is predicted over 140 GiB). The accumulation follows from the
recipe's global batch, so every variant trains the same tokens per step."""
BASELINES = ("stock", "stock_offload", "fsdp2", *TUNED_MICRO_BATCH)
FSDP2_CONFIG = {"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "activation_checkpointing": True}


@dataclass
class Variant:
    """One benchmarked configuration: a name, the launcher, and the train overrides that define it."""

    name: str
    launcher: str  # "deepspeed" or "torchrun"
    overrides: list[str] = field(default_factory=list)
    ds_config: dict | None = None
    recipe_dir: Path | None = None
    """Whose train_args.yaml it starts from: the benchmarked recipe's unless set (`--variant NAME=DIR`)."""
    baseline: str = ""
    """The `*_tuned` baseline it is one setting of (the report names the best of several)."""


@dataclass(frozen=True)
class Tuned:
    """How a `*_tuned` baseline runs: its micro batch and whether it checkpoints activations. The defaults
    (TUNED_MICRO_BATCH, no checkpointing) are what fits Llama-3-8B on 2 x H200; another model or GPU gets its own with
    `hf-zero3 bench --tuned NAME=MICRO[+ckpt]` (e.g. 13b on 2 x H200 fits stock ZeRO-3 only with checkpointing).
    Given twice or more for one baseline, each setting runs: "tuned by hand" means the better of checkpointing on and
    off, each at its largest micro batch (on one H200 a 7B's stock ZeRO-3 ran 1.29-1.35x faster with checkpointing
    at micro 4-8 than without it at micro 1; benchmarks study ckpt-micro-7b-1gpu)."""

    micro: int
    checkpointing: bool = False

    @classmethod
    def parse(cls, text: str) -> tuple[str, Tuned]:
        name, _, rest = text.partition("=")
        micro, plus, flag = rest.partition("+")
        if name not in TUNED_MICRO_BATCH or not micro.isdigit() or int(micro) < 1 or (plus and flag != "ckpt"):
            raise ValueError(f"--tuned {text}: give NAME=MICRO or NAME=MICRO+ckpt with NAME one of "
                             f"{', '.join(TUNED_MICRO_BATCH)}, e.g. stock_tuned=4+ckpt")
        return name, cls(int(micro), bool(plus))

    @staticmethod
    def collect(items: list[str]) -> dict[str, list[Tuned]]:
        """`--tuned` values by baseline, in the order given; a setting given twice runs once."""
        tuned: dict[str, list[Tuned]] = {}
        for item in items:
            name, setting = Tuned.parse(item)
            if setting not in tuned.setdefault(name, []):
                tuned[name].append(setting)
        return tuned


def tuned_variants(name: str, tuned: dict[str, list[Tuned]] | None) -> list[tuple[str, Tuned]]:
    """(variant name, setting) of a `*_tuned` baseline: its own name for one setting, NAME_MICRO[_ckpt] for several."""
    settings = (tuned or {}).get(name) or [Tuned(TUNED_MICRO_BATCH[name])]
    if len(settings) == 1:
        return [(name, settings[0])]
    return [(f"{name}_{s.micro}{'_ckpt' if s.checkpointing else ''}", s) for s in settings]


def tuned_accumulation(name: str, setting: Tuned, global_batch: int, gpus: int) -> int:
    """Gradient accumulation of a `*_tuned` baseline at its micro batch for the recipe's global batch."""
    if global_batch % (setting.micro * gpus):
        raise ValueError(f"{name} runs micro batch {setting.micro} on {gpus} ranks: the global batch {global_batch} is "
                         f"not a multiple of {setting.micro * gpus}; pick --per_device_train_batch_size/"
                         f"--gradient_accumulation_steps so that it is")
    return global_batch // (setting.micro * gpus)


def _tuned(name: str, variant: str, setting: Tuned, global_batch: int, gpus: int) -> Variant:
    # FSDP2 checkpoints through its own config (the Trainer's flag and FSDP's would recompute twice)
    ckpt = setting.checkpointing and name != "fsdp2_tuned"
    batch = ["--per_device_train_batch_size", str(setting.micro),
             "--gradient_accumulation_steps", str(tuned_accumulation(variant, setting, global_batch, gpus)),
             "--gradient_checkpointing", "true" if ckpt else "false", "--use_liger_kernel", "false",
             "--optim", "adamw_torch_fused"]
    if ckpt:
        batch += ["--gradient_checkpointing_kwargs", '{"use_reentrant": false}']
    if name == "fsdp2_tuned":
        fsdp = {**FSDP2_CONFIG, "activation_checkpointing": setting.checkpointing}
        return Variant(variant, "torchrun", ["--deepspeed", "null", "--fsdp", "full_shard auto_wrap",
                                             "--fsdp_config", json.dumps(fsdp), *batch], baseline=name)
    config = copy.deepcopy(STOCK_ZERO2 if name == "zero2_tuned" else STOCK_ZERO3)
    config.pop("optimizer", None)  # the Trainer's own optimizer and scheduler
    config.pop("scheduler", None)
    return Variant(variant, "deepspeed", batch, ds_config=config, baseline=name)


def baseline_groups(variants: list[Variant]) -> dict[str, list[str]]:
    """Baselines run at several settings -> their variants' names (the report compares ours with the best)."""
    groups: dict[str, list[str]] = {}
    for v in variants:
        if v.baseline:
            groups.setdefault(v.baseline, []).append(v.name)
    return {b: names for b, names in groups.items() if len(names) > 1}


def build_variants(recipe_dir: Path, against: list[str], breakdown: bool, on_gpu: bool, *, global_batch: int = 0,
                   gpus: int = 2, others: dict[str, Path] | None = None,
                   tuned: dict[str, list[Tuned]] | None = None) -> list[Variant]:
    """`ours` (the recipe as it is), other recipe folders run the same way, then the requested baselines."""
    ours_config = json.loads((recipe_dir / "ds_config.json").read_text())
    variants = [Variant("ours", "deepspeed", ds_config=ours_config)]
    for name, folder in (others or {}).items():
        variants.append(Variant(name, "deepspeed", ds_config=json.loads((folder / "ds_config.json").read_text()),
                                recipe_dir=folder))
    for name in against:
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}: choose from {', '.join(BASELINES)}")
        if name in TUNED_MICRO_BATCH:
            variants += [_tuned(name, variant, setting, global_batch, gpus)
                         for variant, setting in tuned_variants(name, tuned)]
            continue
        if name == "fsdp2":
            variants.append(Variant(name, "torchrun", ["--deepspeed", "null", "--fsdp", "full_shard auto_wrap",
                                                       "--fsdp_config", json.dumps(FSDP2_CONFIG),
                                                       "--use_liger_kernel", "false"]))
            continue
        config = copy.deepcopy(STOCK_ZERO3)
        if name == "stock_offload":
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
        if not on_gpu:  # DeepSpeed's fused GPU Adam does not exist on CPU; torch's Adam is what runs there
            config["optimizer"]["params"]["torch_adam"] = True
        variants.append(Variant(name, "deepspeed", ["--gradient_checkpointing", "true", "--use_liger_kernel", "false",
                                                    "--gradient_checkpointing_kwargs", '{"use_reentrant": false}'],
                                ds_config=config))
    if breakdown:
        for variant in variants:
            if variant.ds_config is not None:
                variant.ds_config["wall_clock_breakdown"] = True
    return variants


def launch_command(variant: Variant, gpus: int, port: int, yaml_path: Path, overrides: list[str]) -> list[str]:
    if variant.launcher == "torchrun":
        head = ["torchrun", "--nproc_per_node", str(gpus), "--master_port", str(port), "-m", "hf_zero3.train"]
    else:
        head = ["deepspeed", "--num_gpus", str(gpus), "--master_port", str(port), "--module", "hf_zero3.train"]
    return [*head, str(yaml_path), *overrides, *variant.overrides]


def summarize(records: list[dict], warmup: int) -> dict[str, Any]:
    """Medians over the steps after warmup; peaks over the whole run."""
    steps = [r for r in records if "loss" in r and r["step"] > warmup]
    every = [r for r in records if "loss" in r]

    def median(key):
        values = [r[key] for r in steps if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key):
        values = [r[key] for r in every if r.get(key) is not None]
        return max(values) if values else None

    summary = {key: median(key) for key in ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "step_time_s",
                                             "ds_fwd_ms", "ds_bwd_ms", "ds_step_ms")}
    summary.update({key: peak(key) for key in ("gpu_peak_allocated_gb", "gpu_peak_reserved_gb", "host_rss_gb",
                                               "host_peak_rss_gb")})
    summary["final_loss"] = every[-1]["loss"] if every else None
    summary["steps_measured"] = len(steps)
    return summary


def aggregate(runs: list[dict]) -> dict[str, Any]:
    """One variant over its repeats: medians of the runs' medians, peaks over all runs, the runs themselves."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"], "runs": runs}
    summary: dict[str, Any] = {}
    for key in ok[0]:
        values = [r[key] for r in ok if r.get(key) is not None]
        if not values:
            summary[key] = None
        elif key.startswith("gpu_peak") or key in ("host_rss_gb", "host_peak_rss_gb"):
            summary[key] = max(values)
        else:
            summary[key] = statistics.median(values)
    summary["runs"] = runs
    return summary


def hardware_label() -> tuple[str, str]:
    """(short label for file names, long description) of this machine."""
    import torch

    from hf_zero3.plan.hardware import gpu_count

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        short = name.replace("NVIDIA ", "").split()[0]
        count = gpu_count()
        mem = torch.cuda.get_device_properties(0).total_memory / 1024**3
        return f"{count}x{short}", f"{count} x {name} ({mem:.0f} GiB), {os.cpu_count()} CPU cores"
    return f"cpu{os.cpu_count()}", f"CPU only: {os.cpu_count()} cores ({platform.processor() or platform.machine()})"


def versions() -> dict[str, str]:
    """What the report records: package versions from metadata, CUDA and the driver when there is a GPU."""
    import torch

    from hf_zero3.plan.hardware import versions as package_versions

    found = package_versions()
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda or "?"
        try:
            found["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
        except (OSError, subprocess.SubprocessError):
            found["driver"] = "?"
    return found


def _fmt(value, digits=1, scale=1.0, suffix=""):
    return "—" if value is None else f"{value * scale:.{digits}f}{suffix}"


def render_report(meta: dict, results: dict[str, dict]) -> str:
    lines = [f"# {meta['title']}", "", f"Date: {meta['date']}  ", f"Hardware: {meta['hardware']}  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + "  ",
             f"Model: {meta['model']}; sequence length {meta['seq_len']}; global batch {meta['global_batch']} "
             f"sequences ({meta['global_batch'] * meta['seq_len']} tokens) per step; {meta['steps']} measured steps "
             f"after {meta['warmup']} warm-up steps (medians; peaks over the whole run); {meta.get('repeats', 1)} "
             "run(s) per config (medians of the runs' medians; peaks over all runs).", "",
             "Command:", "", "```", *(meta.get("commands") or [meta["command"]]), "```", "",
             "| config | tokens/s/GPU | TFLOP/s/GPU | MFU | peak alloc GiB | peak reserved GiB | host RSS GiB "
             "| step s | fwd/bwd/step ms | final loss | runs: min-max tokens/s/GPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        runs = r.get("runs", [r])
        speeds = [x["tokens_per_s_per_gpu"] for x in runs if x.get("tokens_per_s_per_gpu")]
        failed = [x["error"] for x in runs if "error" in x]
        spread = (f"{len(speeds)}: {min(speeds):.0f}-{max(speeds):.0f}" if speeds else "0") + (
            f" ({len(failed)} failed)" if failed else "")
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | | | | {spread} |")
            continue
        breakdown = "/".join(_fmt(r.get(k), 0) for k in ("ds_fwd_ms", "ds_bwd_ms", "ds_step_ms"))
        lines.append(f"| {name} | {_fmt(r['tokens_per_s_per_gpu'], 0)} | {_fmt(r['tflops_per_gpu'], 1)} | "
                     f"{_fmt(r['mfu'], 1, 100, '%')} | {_fmt(r['gpu_peak_allocated_gb'], 2)} | "
                     f"{_fmt(r['gpu_peak_reserved_gb'], 2)} | {_fmt(r['host_rss_gb'], 2)} | {_fmt(r['step_time_s'], 3)} | "
                     f"{breakdown} | {_fmt(r['final_loss'], 3)} | {spread} |")
    ours = results.get("ours", {}).get("tokens_per_s_per_gpu")  # none when `--only` left ours out
    for name, r in results.items():
        if name != "ours" and ours and "error" not in r and r.get("tokens_per_s_per_gpu"):
            lines.append("")
            lines.append(f"ours / {name}: {ours / r['tokens_per_s_per_gpu']:.2f}x tokens/s")
    for baseline, names in meta.get("groups", {}).items():
        speeds = {n: results[n]["tokens_per_s_per_gpu"] for n in names
                  if n in results and (results[n].get("tokens_per_s_per_gpu") or 0) > 0}
        if ours and speeds:
            best = max(speeds, key=speeds.get)
            lines += ["", f"ours / the best {baseline} ({best}, {speeds[best]:,.0f} tokens/s/GPU; of "
                          f"{', '.join(names)}): {ours / speeds[best]:.2f}x tokens/s"]
    if any(len(r.get("runs", [])) > 1 for r in results.values()):
        lines += ["", "Each run (repeats interleaved: every variant once, then again):", "",
                  "| config | repeat | tokens/s/GPU | MFU | peak alloc GiB | peak reserved GiB | step s |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in results.items():
            for i, x in enumerate(r.get("runs", []), 1):
                if "error" in x:
                    lines.append(f"| {name} | {i} | failed: {x['error']} | | | | |")
                else:
                    lines.append(f"| {name} | {i} | {_fmt(x['tokens_per_s_per_gpu'], 0)} | {_fmt(x['mfu'], 1, 100, '%')} | "
                                 f"{_fmt(x['gpu_peak_allocated_gb'], 2)} | {_fmt(x['gpu_peak_reserved_gb'], 2)} | "
                                 f"{_fmt(x['step_time_s'], 3)} |")
    lines += ["", "MFU uses model FLOPs 6·N + 12·L·H·S per token (PaLM appendix B, N = parameters without "
              "embeddings) against the GPU's dense bf16 peak (`--peak-tflops`, else `hf_zero3.callbacks.throughput.PEAK_TFLOPS`: "
              "989 TFLOP/s for H100 SXM/H200; no MFU for a GPU it does not list).", "",
              "## Resolved configurations", ""]
    for name, config in meta["configs"].items():
        lines += [f"### {name}", "", "```json", json.dumps(config, indent=2, default=str), "```", ""]
    return "\n".join(lines) + "\n"


def plot(path: Path, per_variant: dict[str, list[dict]], title: str = "", warmup: int = 0) -> bool:
    """Loss, tokens/s per GPU and memory per step, one colour per variant (hf_zero3.ops.plots); False without
    matplotlib."""
    from hf_zero3.ops.plots import plot_runs

    return plot_runs(path, per_variant, title, warmup)


def progress_line(label: str, done: int, total: int, elapsed: float) -> str:
    """'label: step 4/10, 12 s, ETA 18 s': the ETA from the mean time per step so far (start-up included)."""
    eta = elapsed / done * (total - done) if done else float("nan")
    return f"{label}: step {done}/{total}, {elapsed:.0f} s, ETA {eta:.0f} s"


def _follow(proc: subprocess.Popen, log: Path, total: int, label: str, limit: float = 0, stop_at: int = 0) -> int:
    """Wait for a run, showing a progress bar from its train_log.jsonl; a run past `limit` seconds (if > 0) is
    stopped and reported as exit 124, so one hung run cannot eat a whole bench. A run that had logged all its steps
    is only exiting: it is stopped too, but it counts (exit 0), since every measurement is in. With `stop_at` (> 0)
    the run is stopped once it has logged that many steps, and counts (exit 0): the first steps of a longer
    schedule."""
    from tqdm import tqdm

    start = time.time()
    on_terminal = sys.stderr.isatty()
    every, reported = max(1, total // 10), 0  # off a terminal (nohup, Slurm): a line per `every` steps instead
    with tqdm(total=total, desc=label, unit="step", file=sys.stderr, disable=not on_terminal) as bar:
        while proc.poll() is None:
            time.sleep(1.0)
            done = sum(1 for line in log.read_text().splitlines() if '"loss"' in line) if log.exists() else 0
            if stop_at and done >= stop_at:
                _stop(proc)
                print(f"{label}: stopped after {done} of {total} steps, as asked", file=sys.stderr, flush=True)
                return 0
            if limit and time.time() - start > limit:
                _stop(proc)
                if done >= total:
                    print(f"{label}: all {total} steps logged; stopped while exiting, after {limit:.0f} s "
                          "(--run-timeout)", file=sys.stderr, flush=True)
                    return 0
                print(f"{label}: stopped after {limit:.0f} s (--run-timeout)", file=sys.stderr, flush=True)
                return 124
            bar.update(max(0, done - bar.n))
            if not on_terminal and done > reported and done >= min(total, reported + every):
                reported = done
                print(progress_line(label, done, total, time.time() - start), file=sys.stderr, flush=True)
    print(f"{label}: exit {proc.returncode} after {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    return proc.returncode


def _stop(proc: subprocess.Popen) -> None:
    """Kill a variant's launcher and everything it started. DeepSpeed's single-node launcher does not pass a
    SIGTERM on, so its ranks would outlive a stopped bench: loading the machine, writing into the work dir."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=30)


def run_bench(recipe_dir: Path, *, steps: int, warmup: int, against: list[str], gpus: int, out_dir: Path,
              work_dir: Path, extra: list[str], breakdown: bool, model_label: str, model: str, seq_len: int,
              global_batch: int, command: str, repeats: int = 1, others: dict[str, Path] | None = None,
              resume: bool = False, run_timeout: float = 0, suffix: str = "",
              only: frozenset[str] = frozenset(),
              tuned: dict[str, list[Tuned]] | None = None) -> tuple[Path, dict[str, str]]:
    """Run every variant `repeats` times (interleaved; with `only`, just those variants) and write <model>_<hardware>_<date>[_<suffix>].md/.jsonl/.png
    into out_dir; returns the .md and the variants whose last run failed (name -> error).

    The report is rewritten after each run, so a bench cut short still leaves what it measured; its state
    (work_dir/bench_state.json) lets `resume` skip the runs already done, e.g. in a second call on the same machine.
    """
    from hf_zero3.run.distributed import cuda_available, free_port

    on_gpu = cuda_available()
    variants = build_variants(recipe_dir, against, breakdown, on_gpu, global_batch=global_batch, gpus=gpus,
                              others=others, tuned=tuned)
    work_dir.mkdir(parents=True, exist_ok=True)
    state_path = work_dir / "bench_state.json"
    state = json.loads(state_path.read_text()) if resume and state_path.exists() else {}
    short_hw, long_hw = hardware_label()
    date = state.get("date") or datetime.date.today().isoformat()
    state.update(date=date, commands=[*state.get("commands", []), command], runs=state.get("runs", {}))
    meta = {"title": f"{model_label} on {short_hw}: hf_zero3 vs stock ({date})", "date": date, "hardware": long_hw,
            "versions": versions(), "model": model, "seq_len": seq_len, "global_batch": global_batch,
            "steps": steps, "warmup": warmup, "repeats": repeats, "command": command, "commands": state["commands"],
            "configs": {}, "groups": baseline_groups(variants)}
    report = out_dir / f"{model_label}_{short_hw}_{date}{'_' + suffix if suffix else ''}.md"
    total = repeats * len(variants)
    for index in range(total):
        repeat, variant = index // len(variants) + 1, variants[index % len(variants)]
        done = state["runs"].setdefault(variant.name, {})
        if str(repeat) in done or (only and not {variant.name, variant.baseline} & only):  # a baseline: all its settings
            continue
        run_dir = work_dir / (variant.name if repeats == 1 else f"{variant.name}-{repeat}")
        scratch_run_dir(run_dir)  # the bench's own scratch run: old records must not mix in
        overrides = ["--max_steps", str(warmup + steps), "--logging_steps", "1", "--save_strategy", "no",
                     "--eval_strategy", "no", "--validation_file", "null", "--report_to", "none",
                     "--output_dir", str(run_dir), "--overwrite_output_dir", "true", "--save_final_model", "false",
                     *extra]
        if variant.ds_config is not None:
            config_path = work_dir / f"{variant.name}_ds_config.json"
            config_path.write_text(json.dumps(variant.ds_config, indent=2))
            overrides += ["--deepspeed", str(config_path)]
        yaml_path = (variant.recipe_dir or recipe_dir) / "train_args.yaml"
        cmd = launch_command(variant, gpus, free_port(), yaml_path, overrides)
        log_path = work_dir / f"{run_dir.name}.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = _follow(proc, run_dir / "train_log.jsonl", warmup + steps,
                               f"[{index + 1}/{total}] {variant.name} run {repeat}", run_timeout)
            finally:
                if proc.poll() is None:  # the bench itself is stopping, or the run hung
                    _stop(proc)
        records = [{"repeat": repeat, **r} for r in _read_jsonl(run_dir / "train_log.jsonl")]
        if code != 0:
            lines = log_path.read_text().strip().splitlines()
            tail = [line for line in lines if line.startswith("error: ")][-1:] or lines[-1:] or ["?"]  # train's own
            summary = {"error": f"exit {code}: {tail[0][:160]} (log: {log_path})"}
        else:
            summary = summarize(records, warmup)
        run_config = run_dir / "run_config.json"
        config = json.loads(run_config.read_text()) if run_config.exists() else {}
        config["command"] = shlex.join(cmd)
        done[str(repeat)] = {"summary": summary, "records": records, "config": config}
        state_path.write_text(json.dumps(state, indent=1))
        _write_state_outputs(report, meta, state, [v.name for v in variants])
    _write_state_outputs(report, meta, state, [v.name for v in variants])
    failed = {name: runs[max(runs, key=int)]['summary']['error'] for name, runs in state['runs'].items()
              if runs and 'error' in runs[max(runs, key=int)]['summary']}
    return report, failed


def scratch_run_dir(run_dir: Path) -> None:
    """Empty the folder one bench or compare run writes, if this tool made it (its owner file says so; an empty
    folder holds nothing to lose); a folder of that name that is someone's data stops the bench, untouched."""
    from hf_zero3.checkpoint.export import claim_staging, mark_staging
    from hf_zero3.checkpoint.lifecycle import CheckpointError

    if run_dir.is_dir() and not run_dir.is_symlink() and not any(run_dir.iterdir()):
        run_dir.rmdir()
    try:
        claim_staging(run_dir)
        run_dir.parent.mkdir(parents=True, exist_ok=True)  # where the owner file goes
        mark_staging(run_dir)
    except CheckpointError as e:
        raise ValueError(f"{e} (it is where a run of this bench would write: pass another --work-dir)") from None


def _write_state_outputs(report: Path, meta: dict, state: dict, names: list[str]) -> None:
    """The report of every run recorded in `state`: this call's variants first, then those of earlier calls."""
    names = [*names, *(n for n in state["runs"] if n not in names)]
    results, per_variant = {}, {}
    for name in names:
        runs = [state["runs"][name][k] for k in sorted(state["runs"].get(name, {}), key=int)]
        if not runs:
            continue
        results[name] = aggregate([r["summary"] for r in runs])
        per_variant[name] = [record for r in runs for record in r["records"]]
        meta["configs"][name] = runs[-1]["config"]
    _write_outputs(report, meta, results, per_variant)


def _write_outputs(report: Path, meta: dict, results: dict, per_variant: dict[str, list[dict]]) -> None:
    report.parent.mkdir(parents=True, exist_ok=True)
    with report.with_suffix(".jsonl").open("w") as f:
        for name, records in per_variant.items():
            for record in records:
                f.write(json.dumps({"variant": name, **record}) + "\n")
    text = render_report(meta, results)
    title = f"{meta['title']}\n{meta['hardware']}"
    if plot(report.with_suffix(".png"), per_variant, title=title, warmup=meta.get("warmup", 0)):
        text += f"\n![loss, tokens/s and memory per step]({report.with_suffix('.png').name})\n"
    report.write_text(text)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
