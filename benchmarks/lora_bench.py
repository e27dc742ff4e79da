"""LoRA against the full fine-tune and against stock `--deepspeed` + peft set up by hand, on one GPU: tokens/s/GPU and
peak GPU memory, each variant a real run in its own process (fresh CUDA context), one timer for all of them.

Variants (same model, data, sequence length, global batch, steps):
  lora         hf_zero3 train with `peft:` (r RANK, alpha 2 x RANK, dropout 0.05, all-linear), the planner's choice
               for the LoRA run (`choose(..., adapter=...)`: on one H200 it is ZeRO-2)
  lora_zero3   the same on the planner's best ZeRO-3 option (the path multi-GPU LoRA takes); it also saves once at
               the last step: the checkpoint's adapter is verified on the GPU and exported (`hf-zero3 export`)
  full         hf_zero3 train, every weight trains, the planner's choice (on one H200: ZeRO-3 + partial CPU offload)
  stock_peft   a stock Trainer script: transformers' documented ZeRO-3 template (its AdamW block; its WarmupLR block
               removed, so the Trainer's schedule applies: the same as ours, SCHEDULE, where WarmupLR can neither
               decay nor start without warmup, and DeepSpeed 0.19.6+ refuses its warmup of 0), peft's
               get_peft_model by hand, gradient checkpointing (non-reentrant, as peft's docs say), the LoRA run's
               micro batch and accumulation, Liger when installed (a switch a user sets without code)
  stock_peft_nockpt  the same without gradient checkpointing (the other setting a user tries), from the micro batch
               of the planner's best ZeRO-3 option without checkpointing
  plain_peft   the same script on the plain Trainer without DeepSpeed (on one GPU, what a user tries first): no
               checkpointing, the LoRA run's micro batch and accumulation, Liger when installed

A stock variant that runs out of GPU memory runs again at the next smaller micro batch (a divisor of the global batch,
the accumulation keeping it), as a user would: the stock setup keeps more than ours (DeepSpeed's linear keeps every
frozen layer's input, peft's adapter is fp32 under ZeRO-3), so our planner's micro batch may not fit it. Each
attempt's log stays (<variant>.m<micro>.log).

Random weights of the model's shape (no download) are written once to WEIGHTS (16 GB for the 8B shape). Results:
OUT/<variant>.json (per-step times, peak memory; repeats OUT/<variant>.r2.json, ...), OUT/lora_bench.jsonl (every
run) and OUT/lora_bench.md (the table: medians over the runs, versions, the resolved configs). With --repeats N the
runs interleave (every variant once, then again). A run whose JSON is there is not run again: the same command
continues.

Usage, from the repository root on the GPU box: bash benchmarks/gpu_lora_8b.sh OUT_DIR
(python3 benchmarks/lora_bench.py --out OUT_DIR [--variants lora,full] [--steps 6] [--warmup 2] ...).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VARIANTS = ("lora", "lora_zero3", "full", "stock_peft", "stock_peft_nockpt", "plain_peft")
STOCK = ("stock_peft", "stock_peft_nockpt", "plain_peft")
"""The variants a user writes by hand (run_stock), not hf_zero3 train."""
DROPOUT = 0.05
"""The adapter's dropout in every LoRA variant (ours and the stock ones)."""
SCHEDULE = {"learning_rate": 1e-4, "lr_scheduler_type": "linear", "warmup_steps": 0}
"""The learning-rate schedule of every variant, ours and stock: the Trainer's linear decay from 1e-4, no warmup."""
DATA = {"tokenizer": "assets/tiny/model", "train_file": "assets/tiny/corpus/train.txt"}


def smaller_micro(micro: int, global_batch: int) -> int | None:
    """The next micro batch down that divides the global batch (one GPU), or None below 1."""
    return next((m for m in range(micro - 1, 0, -1) if global_batch % m == 0), None)


def out_of_memory(log: Path) -> bool:
    return log.is_file() and "CUDA out of memory" in log.read_text(errors="replace")


def _stock_zero3() -> dict:
    """transformers' ZeRO-3 template without its scheduler block: the Trainer's SCHEDULE applies, as in ours."""
    from hf_zero3.ops.baselines import STOCK_ZERO3

    return {k: v for k, v in STOCK_ZERO3.items() if k != "scheduler"}


# --- in the training process ---------------------------------------------------------------------------------------

def step_timer(path: Path, tokens_per_step: int, warmup: int):
    """A TrainerCallback timing each optimizer step (CUDA synchronized) and the peak GPU memory; rank 0 writes `path`."""
    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()  # (a CPU smoke run of this script times without it)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize() if cuda else None
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize() if cuda else None
            self.times.append(time.perf_counter() - self.start)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if not state.is_world_process_zero:
                return
            measured = self.times[warmup:] or self.times
            step = statistics.median(measured)
            trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
            path.write_text(json.dumps({
                "step_times_s": self.times, "median_step_s": step, "warmup": warmup,
                "tokens_per_step": tokens_per_step,
                "tokens_per_s_per_gpu": tokens_per_step / step / max(args.world_size, 1),
                "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
                "trainable_params": trainable, "world_size": args.world_size,
                "losses": [r["loss"] for r in state.log_history if "loss" in r],
            }, indent=1))

    return StepTimer()


def run_ours(spec: dict) -> int:
    from hf_zero3.job.distributed import exit_process
    from hf_zero3.train import main

    timer = step_timer(Path(spec["result"]), spec["tokens_per_step"], spec["warmup"])
    exit_process(main(spec["argv"], extra_callbacks=[timer]))
    return 0


def run_stock(spec: dict) -> int:
    """What a user writes by hand: tokenizer, run_clm's blocks, the model, peft, the Trainer with the ds_config."""
    import importlib.util

    import torch
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    seq = spec["seq_len"]
    args = TrainingArguments(
        output_dir=spec["output_dir"], deepspeed=spec["ds_config"], bf16=True, report_to=[], save_strategy="no",
        per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=spec["grad_accum"],
        max_steps=spec["steps"], **SCHEDULE, logging_steps=1, gradient_checkpointing=spec["checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False}, dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        use_liger_kernel=importlib.util.find_spec("liger_kernel") is not None)
    tokenizer = AutoTokenizer.from_pretrained(DATA["tokenizer"])
    raw = load_dataset("text", data_files=DATA["train_file"], split="train")
    ids = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])

    def blocks(batch):
        flat = [t for row in batch["input_ids"] for t in row]
        chunks = [flat[i:i + seq] for i in range(0, len(flat) - seq + 1, seq)]
        return {"input_ids": chunks, "labels": [list(c) for c in chunks]}

    train = ids.map(blocks, batched=True, batch_size=1000, remove_columns=ids.column_names)
    model = AutoModelForCausalLM.from_pretrained(spec["weights"], dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"], lora_dropout=DROPOUT,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    timer = step_timer(Path(spec["result"]), spec["tokens_per_step"], spec["warmup"])
    Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator,
            callbacks=[timer]).train()
    return 0


# --- the parent: plan, launch, report ------------------------------------------------------------------------------

def ensure_weights(config_dir: Path, weights: Path) -> None:
    """Random bf16 weights of the config's shape, made on the GPU (seconds) and saved once."""
    if (weights / "config.json").is_file() and any(weights.glob("*.safetensors")):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    print(f"lora_bench: writing random weights of {config_dir} to {weights}", flush=True)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    model.save_pretrained(weights, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def planned(args, lora: bool, stage3: bool = False, no_checkpointing: bool = False):
    """(ds_config, training overrides, label, planned GPU GB) of the planner's choice for this run (`stage3`: its best
    ZeRO-3 option; `no_checkpointing`: its best ZeRO-3 option without checkpointing)."""
    from hf_zero3.config.build import build_ds_config, training_args_overrides
    from hf_zero3.plan.choose import choose, cost_key
    from hf_zero3.plan.lora import adapter
    from hf_zero3.plan.profiles import get
    from hf_zero3.plan.shapes import load_shape

    shape = load_shape(str(args.model_config))
    hardware = get(args.hardware).hardware(1, 0.0, None)
    lora_adapter = adapter(shape, args.rank, "all-linear", DROPOUT) if lora else None
    choice = choose(shape, hardware, args.seq_len, global_batch=args.global_batch, adapter=lora_adapter,
                    liger=args.liger)
    best = choice.plan
    if stage3 or no_checkpointing:
        best = min((p for p in choice.tried if p.fits and p.spec.stage == 3
                    and not (no_checkpointing and p.spec.activation_checkpointing)), key=cost_key, default=None)
    if best is None:
        raise SystemExit(f"lora_bench: nothing fits for {'LoRA' if lora else 'the full fine-tune'}: {choice.advice}")
    overrides = training_args_overrides(best.spec)
    if args.liger:
        overrides["use_liger_kernel"] = True
    return build_ds_config(best.spec), overrides, best.label, best.gpu_bytes / 1e9


def ours_argv(args, work: Path, name: str, ds_path: Path, overrides: dict, lora: bool) -> list[str]:
    argv = ["--model_name_or_path", str(args.weights), "--tokenizer_name", DATA["tokenizer"],
            "--train_file", DATA["train_file"], "--validation_file", "null", "--block_size", str(args.seq_len),
            "--deepspeed", str(ds_path), "--output_dir", str(work / name), "--overwrite_output_dir", "true",
            "--max_steps", str(args.steps), "--logging_steps", "1",
            *(x for key, value in SCHEDULE.items() for x in (f"--{key}", str(value))),
            "--report_to", "none", "--save_final_model", "false",
            "--attn_implementation", "sdpa", "--seed", "42"]
    argv += ["--save_strategy", "steps", "--save_steps", str(args.steps)] if name == "lora_zero3" else \
        ["--save_strategy", "no"]
    if lora:
        argv += ["--peft", json.dumps({"r": args.rank, "alpha": 2 * args.rank, "dropout": DROPOUT,
                                       "target_modules": "all-linear"})]
    for key, value in overrides.items():
        argv += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value).lower()
                 if isinstance(value, bool) else str(value)]
    return argv


def launch(spec_path: Path, log: Path, timeout: int, deepspeed: bool = True) -> int:
    """One variant's process: under DeepSpeed's launcher, or plain python for the run without DeepSpeed."""
    from hf_zero3.job.distributed import free_port

    cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port())] if deepspeed else [sys.executable]
    cmd += [__file__, "_run", str(spec_path)]
    with log.open("w") as f:
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def check_save(work: Path, steps: int) -> dict:
    """The lora_zero3 run's checkpoint: complete (its adapter verified on the GPU), and its export."""
    from hf_zero3.checkpoint import contents
    from hf_zero3.checkpoint import lifecycle as ckpt
    from hf_zero3.checkpoint.export import export_checkpoint

    folder = work / "lora_zero3" / f"checkpoint-{steps}"
    found = {"checkpoint": str(folder), "complete": ckpt.is_complete(folder)}
    if found["complete"]:
        out = work / "lora_zero3-adapter"
        if not out.exists():
            export_checkpoint(folder, out, dtype="bf16")
        tensors = contents.adapter_tensors(out)
        found.update({"export": str(out), "tensors": len(tensors), "empty": sum(t.numel() == 0 for t in tensors.values()),
                      "export_bytes": (out / contents.ADAPTER_WEIGHTS).stat().st_size})
    return found


def report(args, results: dict, configs: dict) -> str:
    from hf_zero3.plan.hardware import gpu_name, versions

    def tokens(runs: list[dict]) -> str:
        rates = [r["tokens_per_s_per_gpu"] for r in runs]
        spread = f" ({len(rates)} runs: {min(rates):,.0f}-{max(rates):,.0f})" if len(rates) > 1 else " (1 run)"
        return f"{statistics.median(rates):,.0f}{spread}"

    lines = [f"# LoRA under ZeRO-3: {args.model_config.name} on 1 x {gpu_name() or 'GPU'}, {time.strftime('%Y-%m-%d')}",
             "", f"Command: `{' '.join(sys.argv)}`", "",
             f"Random weights of the shape (no download), sequence {args.seq_len}, global batch {args.global_batch} "
             f"sequences, {args.steps} steps, medians after {args.warmup} warm-up steps; LoRA r {args.rank}, alpha "
             f"{2 * args.rank}, dropout {DROPOUT}, all-linear; every variant's schedule: "
             f"{SCHEDULE['lr_scheduler_type']} from {SCHEDULE['learning_rate']:g}, {SCHEDULE['warmup_steps']} warmup "
             "steps. Versions: "
             + ", ".join(f"{k} {v}" for k, v in versions().items()) + ".", "",
             "| variant | config | trainable params | tokens/s/GPU, median | peak alloc GiB, max "
             "| peak reserved GiB, max | planned GB | failed runs |", "|---|---|---|---|---|---|---|---|"]
    for name in args.variants:
        runs, c = results.get(name, []), configs.get(name, {})
        ok = [r for r in runs if "tokens_per_s_per_gpu" in r]
        failed = ", ".join(f"run {i + 1} exit {r.get('rc')}" for i, r in enumerate(runs) if r not in ok) or "none"
        if not ok:
            lines.append(f"| {name} | {c.get('label', '')} | | failed (see {name}*.log) | | | | {failed} |")
            continue
        allocated, reserved = (max(r[key] for r in ok) for key in ("peak_allocated_gib", "peak_reserved_gib"))
        lines.append(f"| {name} | {c.get('label', '')} | {ok[0]['trainable_params']:,} | {tokens(ok)} "
                     f"| {allocated:.1f} | {reserved:.1f} | {c.get('planned_gb', 0):.1f} | {failed} |")
    if "save" in results:
        lines += ["", f"lora_zero3's save: {json.dumps(results['save'])}"]
    lines += ["", "## Resolved configs", ""]
    for name, c in configs.items():
        lines += [f"### {name}", "", "```json", json.dumps(c, indent=1, default=str), "```", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    if "_run" in sys.argv[1:3]:  # a variant's process (the launcher puts --local_rank first)
        spec = json.loads(Path(sys.argv[sys.argv.index("_run") + 1]).read_text())
        return run_stock(spec) if spec["kind"] == "stock" else run_ours(spec)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "lora-bench")
    parser.add_argument("--model-config", type=Path, default=ROOT / "outputs" / "llama3-8b")
    parser.add_argument("--weights", type=Path, default=ROOT / "outputs" / "llama3-8b-weights")
    parser.add_argument("--hardware", default="h200x1", help="the planner's profile of this machine")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--liger", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--run-timeout", type=int, default=420)
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant, interleaved")
    args = parser.parse_args()
    if args.liger is None:
        import importlib.util

        args.liger = importlib.util.find_spec("liger_kernel") is not None
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    ensure_weights(args.model_config, args.weights)
    results, configs = {}, {}
    tokens_per_step = args.global_batch * args.seq_len
    for name in args.variants:
        lora = name != "full"
        ds, overrides, label, gpu_gb = planned(args, lora, stage3=name == "lora_zero3",
                                               no_checkpointing=name == "stock_peft_nockpt")
        stock = name in STOCK
        if name == "plain_peft":
            ds, label = None, "plain Trainer (no DeepSpeed) + peft by hand, no checkpointing"
        elif stock:
            ds, label = _stock_zero3(), ("transformers' ZeRO-3 template (no scheduler block) + peft by hand"
                                         + (", checkpointing" if name == "stock_peft" else ", no checkpointing"))
        configs[name] = {"label": label, "planned_gb": 0 if stock else gpu_gb, "ds_config": ds,
                         "training_overrides": overrides}
    for repeat, name in ((r, n) for r in range(1, args.repeats + 1) for n in args.variants):
        result = args.out / (f"{name}.json" if repeat == 1 else f"{name}.r{repeat}.json")
        stock, lora, overrides = name in STOCK, name != "full", configs[name]["training_overrides"]
        if not result.is_file():
            shutil.rmtree(args.work / name, ignore_errors=True)  # an earlier attempt's files
            ds_path = args.work / f"{name}_ds_config.json"
            ds_path.write_text(json.dumps(configs[name]["ds_config"], indent=1))
            spec = {"kind": "stock" if stock else "ours", "result": str(result),
                    "tokens_per_step": tokens_per_step, "warmup": args.warmup}
            if stock:
                spec.update({"ds_config": str(ds_path) if configs[name]["ds_config"] else None,
                         "seq_len": args.seq_len, "steps": args.steps,
                             "checkpointing": name == "stock_peft",
                             "micro_batch": overrides["per_device_train_batch_size"],
                             "grad_accum": overrides["gradient_accumulation_steps"], "rank": args.rank,
                             "weights": str(args.weights), "output_dir": str(args.work / name)})
            else:
                spec["argv"] = ours_argv(args, args.work, name, ds_path, overrides, lora)
            spec_path = args.work / f"{name}_spec.json"
            while True:
                spec_path.write_text(json.dumps(spec, indent=1))
                print(f"lora_bench: {name} run {repeat}: {configs[name]['label']}", flush=True)
                rc = launch(spec_path, result.with_suffix(".log"), args.run_timeout, name != "plain_peft")
                smaller = smaller_micro(spec.get("micro_batch", 1), args.global_batch)
                if not stock or result.is_file() or smaller is None or not out_of_memory(result.with_suffix(".log")):
                    break
                tried = spec["micro_batch"]  # out of memory: the next micro batch down, as a user would
                result.with_suffix(".log").rename(result.with_suffix(f".m{tried}.log"))
                spec.update({"micro_batch": smaller, "grad_accum": args.global_batch // smaller})
                overrides.update({"per_device_train_batch_size": smaller,
                                  "gradient_accumulation_steps": args.global_batch // smaller})
                configs[name]["label"] += f"; micro {tried} ran out of memory"
                shutil.rmtree(args.work / name, ignore_errors=True)
            if not result.is_file():
                result.write_text(json.dumps({"rc": rc}))
            if name == "lora_zero3" and "tokens_per_s_per_gpu" in json.loads(result.read_text()):
                (args.out / "lora_zero3_save.json").write_text(json.dumps(check_save(args.work, args.steps)))
        results.setdefault(name, []).append(json.loads(result.read_text()))
        shown = {k: v for k, v in results[name][-1].items() if k != "step_times_s"}
        print(f"lora_bench: {name} run {repeat}: {json.dumps(shown)}", flush=True)
    if (args.out / "lora_zero3_save.json").is_file():
        results["save"] = json.loads((args.out / "lora_zero3_save.json").read_text())
    with (args.out / "lora_bench.jsonl").open("w") as f:
        for name, runs in results.items():
            for repeat, r in enumerate(runs if name != "save" else [runs], 1):
                f.write(json.dumps({"variant": name, "repeat": repeat, **r,
                                    **({"config": configs[name]} if name in configs else {})}) + "\n")
    (args.out / "lora_bench.md").write_text(report(args, results, configs))
    print((args.out / "lora_bench.md").read_text())
    return 0 if all("tokens_per_s_per_gpu" in r for n in args.variants for r in results.get(n, [{}])) else 1


if __name__ == "__main__":
    sys.exit(main())
