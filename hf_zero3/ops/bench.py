"""`hf-zero3 bench`: our recipe and the baselines (`ops.baselines`), one after another, on the same model,
sequence length, global batch and GPUs; one report with tokens/s, TFLOP/s, MFU and memory side by side, and ours
against the best baseline that ran.

Each variant is a real `hf_zero3.train` run in its own process group (fresh CUDA context, fresh peak
memory), launched as a user would launch it: DeepSpeed's launcher for ZeRO, torchrun for FSDP2 and the plain Trainer.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hf_zero3.checkpoint.export import claim_staging, mark_staging
from hf_zero3.checkpoint.lifecycle import CheckpointError
from hf_zero3.ops.baselines import (
    BASELINES,
    Search,
    Tuned,
    Variant,
    build_slots,
    search_state,
    selected,
    variants_of,
)
from hf_zero3.plan.hardware import gpu_count, gpu_name
from hf_zero3.plan.hardware import versions as package_versions
from hf_zero3.job.distributed import cuda_available, free_port
from hf_zero3.run.oom import oom_in_log
from hf_zero3.run.plots import plot_runs
from hf_zero3.units import current_names


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
    summary.update({key: peak(key) for key in ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib", "host_rss_gib",
                                               "host_peak_rss_gib")})
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
        elif key.startswith("gpu_peak") or key in ("host_rss_gib", "host_peak_rss_gib"):
            summary[key] = max(values)
        else:
            summary[key] = statistics.median(values)
    summary["runs"] = runs
    return summary


def hardware_label() -> tuple[str, str]:
    """(short label for file names, long description) of this machine."""
    import torch  # torch takes a second to import: `hf-zero3 bench --help` and the report-only path do without

    if (name := gpu_name()) is not None:
        short = name.replace("NVIDIA ", "").split()[0]
        count = gpu_count()
        mem = torch.cuda.get_device_properties(0).total_memory / 1024**3
        return f"{count}x{short}", f"{count} x {name} ({mem:.0f} GiB), {os.cpu_count()} CPU cores"
    return f"cpu{os.cpu_count()}", f"CPU only: {os.cpu_count()} cores ({platform.processor() or platform.machine()})"


def versions() -> dict[str, str]:
    """What the report records: package versions from metadata, CUDA and the driver when there is a GPU."""
    import torch  # as in hardware_label

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
                     f"{_fmt(r['mfu'], 1, 100, '%')} | {_fmt(r['gpu_peak_allocated_gib'], 2)} | "
                     f"{_fmt(r['gpu_peak_reserved_gib'], 2)} | {_fmt(r['host_rss_gib'], 2)} | {_fmt(r['step_time_s'], 3)} | "
                     f"{breakdown} | {_fmt(r['final_loss'], 3)} | {spread} |")
    ours = results.get("ours", {}).get("tokens_per_s_per_gpu")  # none when `--only` left ours out
    for name, r in results.items():
        if name != "ours" and ours and "error" not in r and r.get("tokens_per_s_per_gpu"):
            lines.append("")
            lines.append(f"ours / {name}: {ours / r['tokens_per_s_per_gpu']:.2f}x tokens/s")
    lines += best_baseline_lines(results, meta.get("baselines", {}), ours)
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
                                 f"{_fmt(x['gpu_peak_allocated_gib'], 2)} | {_fmt(x['gpu_peak_reserved_gib'], 2)} | "
                                 f"{_fmt(x['step_time_s'], 3)} |")
    lines += ["", "MFU uses model FLOPs 6·N + 12·L·H·S per token (PaLM appendix B, N = parameters without "
              "embeddings) against the GPU's dense bf16 peak (`--peak-tflops`, else `hf_zero3.callbacks.throughput.PEAK_TFLOPS`: "
              "989 TFLOP/s for H100 SXM/H200; no MFU for a GPU it does not list).", "",
              "## Resolved configurations", ""]
    for name, config in meta["configs"].items():
        lines += [f"### {name}", "", "```json", json.dumps(config, indent=2, default=str), "```", ""]
    return "\n".join(lines) + "\n"


def best_baseline_lines(results: dict[str, dict], baselines: dict[str, str], ours: float | None) -> list[str]:
    """The report's verdict: per baseline run at several settings its best, then the best baseline of all that ran,
    ours against it, and every baseline run that failed, with its error (a failure is a result, never dropped)."""
    of = {name: baselines.get(name) or (name if name in BASELINES else "") for name in results}
    of = {name: b for name, b in of.items() if b}
    if not of:
        return []
    speed = {n: results[n]["tokens_per_s_per_gpu"] for n in of
             if "error" not in results[n] and (results[n].get("tokens_per_s_per_gpu") or 0) > 0}
    lines = []
    for baseline in dict.fromkeys(of.values()):
        group = [n for n, b in of.items() if b == baseline]
        ran = {n: speed[n] for n in group if n in speed}
        if ours and len(group) > 1 and ran:
            best = max(ran, key=ran.get)
            lines += ["", f"ours / the best {baseline} ({best}, {ran[best]:,.0f} tokens/s/GPU; of "
                          f"{', '.join(group)}): {ours / ran[best]:.2f}x tokens/s"]
    failed = [f"{n} ({results[n]['error'].split(' (log: ')[0]})" for n in of if "error" in results[n]]
    if speed:
        best = max(speed, key=speed.get)
        ratio = f"; ours / it: **{ours / speed[best]:.2f}x** tokens/s" if ours else ""
        lines += ["", f"**The best baseline: {best}** ({speed[best]:,.0f} tokens/s/GPU, the fastest of the "
                      f"{len(speed)} baseline configs that ran){ratio}"]
    else:
        lines += ["", "No baseline ran: there is no best baseline to compare with."]
    if failed:
        lines += ["", "Baseline runs that failed (counted as results, not dropped): " + "; ".join(failed)]
    return lines


def plot(path: Path, per_variant: dict[str, list[dict]], title: str = "", warmup: int = 0) -> bool:
    """Loss, tokens/s per GPU and memory per step, one colour per variant (hf_zero3.run.plots); False without
    matplotlib."""
    return plot_runs(path, per_variant, title, warmup)


def progress_line(label: str, done: int, total: int, elapsed: float) -> str:
    """'label: step 4/10, 12 s, ETA 18 s': the ETA from the mean time per step so far (start-up included)."""
    eta = elapsed / done * (total - done) if done else float("nan")
    return f"{label}: step {done}/{total}, {elapsed:.0f} s, ETA {eta:.0f} s"


def follow_run(proc: subprocess.Popen, log: Path, total: int, label: str, limit: float = 0, stop_at: int = 0) -> int:
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
                stop_run(proc)
                print(f"{label}: stopped after {done} of {total} steps, as asked", file=sys.stderr, flush=True)
                return 0
            if limit and time.time() - start > limit:
                stop_run(proc)
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


def stop_run(proc: subprocess.Popen) -> None:
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
              only: frozenset[str] = frozenset(), tuned: dict[str, list[Tuned]] | None = None,
              time_budget: float = 0) -> tuple[Path, dict[str, str], int]:
    """Run every config `repeats` times, interleaved (with `only`, just those), and write
    <model>_<hardware>_<date>[_<suffix>].md/.jsonl/.png into out_dir. A tuned baseline's setting searches its micro
    batch in the first round (`ops.baselines.Search`); later rounds run the micro batch it found.

    Returns the .md, the configs whose last run failed other than by a search's out-of-memory (name -> error), and
    the runs left undone because `time_budget` (seconds, > 0) would have been passed: after the first run of a call,
    a run is started only while the time spent plus its expected length (`expected_seconds`) fits it.

    The report is rewritten after each run, so a bench cut short still leaves what it measured; its state
    (work_dir/bench_state.json) lets `resume` skip the runs already done, e.g. in a second call on the same machine.
    """
    on_gpu = cuda_available()
    slots = build_slots(recipe_dir, against, breakdown, on_gpu, global_batch=global_batch, gpus=gpus,
                        others=others, tuned=tuned)
    work_dir.mkdir(parents=True, exist_ok=True)
    state_path = work_dir / "bench_state.json"
    state = _read_state(state_path) if resume and state_path.exists() else {}
    short_hw, long_hw = hardware_label()
    date = state.get("date") or datetime.date.today().isoformat()
    state.update(date=date, commands=[*state.get("commands", []), command], runs=state.get("runs", {}))
    meta = {"title": f"{model_label} on {short_hw}: hf_zero3 vs stock ({date})", "date": date, "hardware": long_hw,
            "versions": versions(), "model": model, "seq_len": seq_len, "global_batch": global_batch,
            "steps": steps, "warmup": warmup, "repeats": repeats, "command": command, "commands": state["commands"],
            "configs": {}, "baselines": {}}
    report = out_dir / f"{model_label}_{short_hw}_{date}{'_' + suffix if suffix else ''}.md"

    def run(variant: Variant, repeat: int, label: str) -> dict:
        return _run_variant(variant, repeat, repeats, gpus, recipe_dir, work_dir, steps, warmup, extra, run_timeout,
                            label)

    runs = _Runs(state, state_path, report, meta, slots, repeats, time_budget, run)
    for repeat in range(1, repeats + 1):
        for slot in slots:
            runs.slot(slot, repeat, only)
    _write_state_outputs(report, meta, state, runs.names, slots)
    return report, failed_configs(state, slots), runs.left


class _Runs:
    """One call's runs in order: each skipped when recorded, or left when the time budget would be passed; each
    recorded, with the report rewritten, as it ends. `at` and `extra`: where in the grid of repeats x configs (plus a
    search's further attempts), for the progress line."""

    def __init__(self, state: dict, state_path: Path, report: Path, meta: dict, slots: list, repeats: int,
                 time_budget: float, run):
        self.state, self.state_path, self.report, self.meta, self.slots = state, state_path, report, meta, slots
        self.names = [v.name for v in variants_of(slots)]
        self.repeats, self.time_budget, self.run = repeats, time_budget, run
        self.started, self.longest, self.left, self.count = time.time(), 0.0, 0, 0
        self.at, self.extra = 0, 0

    def slot(self, slot: Variant | Search, repeat: int, only: frozenset[str]) -> None:
        """One config of the grid: a variant's run, the runs `--only` names of a search, or the search."""
        self.at += 1
        if not selected(slot, only):
            return
        if isinstance(slot, Variant):
            self.one(slot, repeat)
            return
        named = [v for v in slot.candidates if v.name in only]
        if named:  # `--only` named runs of this search: those, no search
            for variant in named:
                self.one(variant, repeat)
            return
        self.search(slot, repeat)

    def search(self, slot: Search, repeat: int) -> None:
        """A tuned setting's micro batch searched in the first round; later rounds run the micro batch it found."""
        tried = 0
        while True:
            first_runs = {v.name: self.state["runs"][v.name]["1"]["summary"] for v in slot.candidates
                          if "1" in self.state["runs"].get(v.name, {})}
            where, variant = search_state(slot, first_runs)
            if where == "next" and repeat == 1:
                if tried:  # the search goes on: one more run than the grid counts
                    self.at += 1
                    self.extra += 1
                tried += 1
                before = self.left
                self.one(variant, 1)
                if self.left > before:  # out of time: the search goes on in the next call
                    return
                continue
            if where == "found":
                self.one(variant, repeat)
            elif where == "next":  # a later round before this call's search: it waits for the first round
                self.left += 1
            return

    def one(self, variant: Variant, repeat: int) -> None:
        """One run, unless recorded already or out of time; recorded in the state and the report."""
        state = self.state
        if str(repeat) in state["runs"].get(variant.name, {}):
            return
        if self.time_budget and self.count and time.time() - self.started + \
                expected_seconds(state, variant.name, self.longest) > self.time_budget:
            self.left += 1
            return
        self.count += 1
        began = time.time()
        record = self.run(variant, repeat, f"[{self.at}/{self.repeats * len(self.slots) + self.extra}] "
                                           f"{variant.name} run {repeat}")
        record["seconds"] = round(time.time() - began, 1)
        state["runs"].setdefault(variant.name, {})[str(repeat)] = record
        self.longest = max(self.longest, record["seconds"])
        self.state_path.write_text(json.dumps(state, indent=1))
        _write_state_outputs(self.report, self.meta, state, self.names, self.slots)


def failed_configs(state: dict, slots: list) -> dict[str, str]:
    """The configs whose last run failed (name -> error), a search's out-of-memory runs excepted."""
    searched = {v.name for v in variants_of(slots) if v.setting}
    failed = {}
    for name, runs in state["runs"].items():
        last = runs[max(runs, key=int)]["summary"] if runs else {}
        if "error" in last and not (name in searched and last.get("out_of_memory")):
            failed[name] = last["error"]
    return failed


def expected_seconds(state: dict, name: str, longest: float) -> float:
    """How long a run of `name` should take, for the time budget: its own last recorded run, else the longest run
    recorded (this call's included in `longest`)."""
    own = [r["seconds"] for _, r in sorted(state["runs"].get(name, {}).items(), key=lambda kv: int(kv[0]))
           if r.get("seconds")]
    if own:
        return own[-1]
    return max([longest, *(r.get("seconds") or 0 for runs in state["runs"].values() for r in runs.values())])


def _run_variant(variant: Variant, repeat: int, repeats: int, gpus: int, recipe_dir: Path, work_dir: Path,
                 steps: int, warmup: int, extra: list[str], run_timeout: float, label: str) -> dict:
    """One run of a variant: its summary (or its error, and whether it ran out of memory), records and config."""
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
            code = follow_run(proc, run_dir / "train_log.jsonl", warmup + steps, label, run_timeout)
        finally:
            if proc.poll() is None:  # the bench itself is stopping, or the run hung
                stop_run(proc)
    records = [{"repeat": repeat, **r} for r in read_jsonl(run_dir / "train_log.jsonl")]
    if code != 0:
        text = log_path.read_text()
        lines = text.strip().splitlines()
        tail = [line for line in lines if line.startswith("error: ")][-1:] or lines[-1:] or ["?"]  # train's own
        summary = {"error": f"exit {code}: {tail[0][:160]} (log: {log_path})"}
        if code != 124 and oom_in_log(text):
            summary["out_of_memory"] = True
            summary["error"] = f"out of memory at micro batch {variant.micro or '?'}: {summary['error']}"
    else:
        summary = summarize(records, warmup)
    run_config = run_dir / "run_config.json"
    config = json.loads(run_config.read_text()) if run_config.exists() else {}
    config["command"] = shlex.join(cmd)
    return {"summary": summary, "records": records, "config": config}


def scratch_run_dir(run_dir: Path) -> None:
    """Empty the folder one bench or compare run writes, if this tool made it (its owner file says so; an empty
    folder holds nothing to lose); a folder of that name that is someone's data stops the bench, untouched."""
    if run_dir.is_dir() and not run_dir.is_symlink() and not any(run_dir.iterdir()):
        run_dir.rmdir()
    try:
        claim_staging(run_dir)
        run_dir.parent.mkdir(parents=True, exist_ok=True)  # where the owner file goes
        mark_staging(run_dir)
    except CheckpointError as e:
        raise ValueError(f"{e} (it is where a run of this bench would write: pass another --work-dir)") from None


def _write_state_outputs(report: Path, meta: dict, state: dict, names: list[str],
                         slots: list[Variant | Search] = ()) -> None:
    """The report of every run recorded in `state`: this call's variants first, then those of earlier calls."""
    names = [*names, *(n for n in state["runs"] if n not in names)]
    state["baselines"] = meta["baselines"] = {**state.get("baselines", {}),
                                              **{v.name: v.baseline for v in variants_of(list(slots)) if v.baseline}}
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


def read_jsonl(path: Path) -> list[dict]:
    """A train_log.jsonl's records, under today's field names (`units.current_names`)."""
    return [current_names(json.loads(line)) for line in path.read_text().splitlines()] if path.exists() else []


def _read_state(path: Path) -> dict:
    """A bench_state.json to resume, its summaries and records under today's field names."""
    state = json.loads(path.read_text())
    for runs in state.get("runs", {}).values():
        for run in runs.values():
            run["summary"] = current_names(run.get("summary", {}))
            run["records"] = [current_names(r) for r in run.get("records", [])]
    return state
