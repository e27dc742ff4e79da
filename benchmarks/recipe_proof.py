"""A recipe proven on the GPUs at hand: the planner's configuration for this hardware (or the recipe's
own ds_config with `--as-shipped`), a Llama-2-shaped model with random weights (layer-scaled with `--layers`),
`hf-zero3 bench` for tokens/s, MFU and peak GPU memory, and this node's host RAM sampled meanwhile; then the
measurement against the planner's prediction for the same run, written to <out>/<name>_proof.json.

  python benchmarks/recipe_proof.py --recipe 7b --gpus 1 --gpu-mem 141GiB --host-ram 256GiB --steps 20 \
      --out DIR --work WORK [--as-shipped] [--layers 4] [--accum 2] [--against stock_tuned] [--tag NAME]
      [--tuned stock_tuned=4+ckpt] [--repeats 3] [--global-batch 24] [--variant NAME=KEY=VALUE] [--only NAMES]

Host RAM is MemTotal - MemAvailable of the whole node (page cache excluded), peak minus its value before the
launch; the planner's host figure is per node too. GPU memory is torch.cuda.max_memory_allocated, max over ranks.
On CPU (`--cpu`, CI-sized: the tiny recipe) it checks the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_probe import HostSampler  # noqa: E402  (node host RAM: MemTotal - MemAvailable)
from hf_zero3.argtypes import parse_size  # noqa: E402
from hf_zero3.config.build import build_ds_config  # noqa: E402
from hf_zero3.config.presets import RECIPE_CONFIGS, STANDALONE_CONFIGS, render  # noqa: E402
from hf_zero3.config.spec import ZeroSpec  # noqa: E402
from hf_zero3.ops.bench import scratch_run_dir  # noqa: E402
from hf_zero3.plan.choose import choose  # noqa: E402
from hf_zero3.plan.memory import plan
from hf_zero3.plan.shapes import load_shape, with_changes  # noqa: E402
from hf_zero3.plan.types import Hardware, Training
from hf_zero3.recipes import get as get_recipe  # noqa: E402
from hf_zero3.job.arguments import load_arguments  # noqa: E402
from hf_zero3.units import current_names  # noqa: E402

GiB = 1024**3


def write_model_config(shape, folder: Path) -> None:
    """A Llama config of the shape, or for a mixture of experts a Qwen3-MoE one (its experts, top-k and widths)."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                  head_dim=shape.head_dim, max_position_embeddings=max(shape.max_positions, 4096),
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=3)
    if shape.experts:
        Qwen3MoeConfig(**common, num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                       moe_intermediate_size=shape.expert_ffn, norm_topk_prob=True).save_pretrained(folder)
    else:
        LlamaConfig(**common).save_pretrained(folder)


def liger_installed() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu-mem", type=parse_size, default=parse_size("141GiB"))
    ap.add_argument("--host-ram", type=parse_size, required=True)
    ap.add_argument("--layers", type=int, help="layer-scaled: this many layers at the recipe's exact width")
    ap.add_argument("--as-shipped", action="store_true", help="the recipe's ds_config, not the planner's choice")
    ap.add_argument("--spec", help="with --as-shipped: this named spec (ds_configs/<name>.json, or a recipe's) "
                    "instead of the recipe's, e.g. zero3_offload_optimizer for the 70b recipe's v1")
    ap.add_argument("--micro", type=int, help="with --as-shipped: the micro batch (default: the recipe's)")
    ap.add_argument("--accum", type=int, help="with --as-shipped: the accumulation (default: the recipe's)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--against", default="")
    ap.add_argument("--tuned", action="append", default=[], metavar="NAME=MICRO[+ckpt]",
                    help="passed to bench: a *_tuned baseline's micro batch and checkpointing for this model")
    ap.add_argument("--repeats", type=int, default=1, help="passed to bench: runs per config, interleaved")
    ap.add_argument("--resume", action="store_true", help="continue a proof of the same --tag cut short (same "
                    "--work, same machine): the runs bench recorded are kept")
    ap.add_argument("--global-batch", type=int, help="the planner's choice at this global batch (sequences per "
                    "step): accumulation fills it, so the baselines train the same tokens per step")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                    help="also run ours with these ds_config keys changed (dotted, JSON values), e.g. "
                         "persist=zero_optimization.stage3_param_persistence_threshold=100000000000")
    ap.add_argument("--only", help="passed to bench: run just these configs (comma-separated)")
    ap.add_argument("--time-budget", type=int, default=0, help="passed to bench: start runs only while they fit in "
                    "SECONDS; the same command with --resume continues")
    ap.add_argument("--prepare-only", action="store_true", help="write the model config and our recipe folder (the "
                    "planner's choice) under --work and print the folder; run nothing")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--run-timeout", type=int, default=0)
    ap.add_argument("--tag", help="name of this proof (default: <recipe>[-<layers>L])")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="plumbing check on CPU: the tiny shape, fp32, tiny sizes")
    args = ap.parse_args(argv)

    recipe = get_recipe(args.recipe)
    name = args.tag or (f"{args.recipe}-{args.layers}L" if args.layers else args.recipe)
    shape = load_shape(args.recipe)  # a named shape or the recipe's own model
    if args.layers:
        shape = with_changes(shape, layers=args.layers, name=f"{shape.name}-{args.layers}L")
    work = args.work / name
    model_dir, variant_dir = work / "model", work / "recipe"
    resume = args.resume and (work / "runs" / "bench_state.json").is_file()
    if not resume:
        scratch_run_dir(work)  # emptied only if an earlier proof made it
    # written again when resuming too (the same shape and choice): a bench continued on a fresh machine from the
    # state of an earlier call finds them
    write_model_config(shape, model_dir)
    shutil.rmtree(variant_dir, ignore_errors=True)
    shutil.copytree(recipe.folder, variant_dir)
    hardware = Hardware(nodes=1, gpus_per_node=args.gpus, gpu_mem=args.gpu_mem, host_ram=args.host_ram)
    liger = liger_installed() and not args.cpu
    precision = "fp32" if args.cpu else "bf16"

    if args.as_shipped:
        values = load_arguments([str(recipe.folder / "train_args.yaml")])
        micro = args.micro or values.get("per_device_train_batch_size", 1)
        accum = args.accum or values.get("gradient_accumulation_steps", 1)
        liger = bool(values.get("use_liger_kernel")) and liger
        base = {**STANDALONE_CONFIGS, **RECIPE_CONFIGS}[args.spec or args.recipe]
        spec = ZeroSpec(**{**base.model_dump(exclude_unset=True), "precision": precision,
                           "activation_checkpointing": bool(values.get("gradient_checkpointing"))})
        if args.spec:
            (variant_dir / "ds_config.json").write_text(render(build_ds_config(spec)))
        planned = plan(shape, hardware, Training(args.seq_len, micro, accum, load_bytes=4, liger=liger), spec)
        train_args = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum}
        how = f"the {args.spec} spec with the recipe's arguments" if args.spec else "the recipe's ds_config as shipped"
    else:
        choice = choose(shape, hardware, args.seq_len, global_batch=args.global_batch, precision=precision,
                        load_bytes=4, liger=liger)
        if not choice.fits:
            print(f"error: the planner finds nothing that fits: {choice.advice}", file=sys.stderr)
            return 2
        planned = choice.plan
        (variant_dir / "ds_config.json").write_text(json.dumps(choice.ds_config, indent=2))
        train_args = dict(choice.training_args)
        how = f"the planner's choice: {describe_plan(planned)}"
    # in our folder's train_args.yaml, not on the command line, so that a --variant can change them
    update_train_args(variant_dir, {"use_liger_kernel": liger, **train_args})
    if args.prepare_only:
        print(json.dumps({"recipe": str(variant_dir), "model": str(model_dir), "how": how}))
        return 0
    extra = ["--model_name_or_path", "null", "--config_name", str(model_dir), "--tokenizer_name",
             str(ROOT / "assets" / "tiny" / "model"), "--train_file", str(ROOT / "assets/tiny/corpus/train.txt"),
             "--block_size", str(args.seq_len)]
    if yaml.safe_load((recipe.folder / "train_args.yaml").read_text()).get("config_overrides"):
        extra += ["--config_overrides", "null"]  # the recipe's full shape would reshape the layer-scaled config
    if args.cpu:
        extra += ["--use_cpu", "true", "--bf16", "false"]
    cmd = [sys.executable, "-m", "hf_zero3", "bench", str(variant_dir), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--gpus", str(args.gpus), "--label", name, "--suffix", "proof", "--out",
           str(args.out), "--work-dir", str(work / "runs")]
    cmd += ["--against", args.against]  # bench's default adds the stock baseline: none unless asked
    cmd += [f"--tuned={item}" for item in args.tuned] + ["--repeats", str(args.repeats)]
    for item in args.variant:
        cmd += [f"--variant={write_variant(item, variant_dir, work)}"]
    if args.only:
        cmd += ["--only", args.only]
    if resume:
        cmd += ["--resume"]
    if args.breakdown:
        cmd += ["--breakdown"]
    if args.run_timeout:
        cmd += ["--run-timeout", str(args.run_timeout)]
    if args.time_budget:
        cmd += ["--time-budget", str(args.time_budget)]
    cmd += ["--", *extra]
    print("$", " ".join(cmd), flush=True)
    sampler = HostSampler(interval=0.25)
    sampler.start()
    started = time.time()
    code = subprocess.call(cmd, cwd=ROOT)
    host = sampler.result()
    host_peak = int(host["peak_minus_baseline_gib"] * GiB)
    reports = sorted(args.out.glob(f"{name}_*_proof.jsonl"))
    records = [current_names(json.loads(line)) for line in reports[-1].read_text().splitlines()] if reports else []
    ours = [r for r in records if r.get("variant") == "ours" and "loss" in r]
    measured_gpu = max((r.get("gpu_peak_allocated_gib") or 0) for r in ours) * GiB if ours else None
    steps = [r for r in ours if r["step"] > args.warmup]

    def median(key):
        values = sorted(r[key] for r in steps if r.get(key) is not None)
        return values[len(values) // 2] if values else None

    # `hf-zero3 bench` saves nothing: its host RAM is compared with the plan without a save's 16-bit gather
    no_save = plan(planned.shape, planned.hardware, planned.training,
                   planned.spec.model_copy(update={"gather_16bit_weights_on_save": False}))
    result = {
        "name": name, "recipe": args.recipe, "recipe_version": recipe.version if hasattr(recipe, "version") else None,
        "how": how, "exit": code, "wall_s": round(time.time() - started, 1),
        "model": {"params": shape.params, "layers": shape.layers, "hidden": shape.hidden, "ffn": shape.ffn,
                  "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab,
                  "active_params": shape.active_params, "experts": shape.experts},
        "hardware": {"gpus": args.gpus, "gpu_mem": args.gpu_mem, "host_ram": args.host_ram},
        "training": {"seq_len": args.seq_len, "micro_batch": planned.training.micro_batch,
                     "grad_accum": planned.training.grad_accum, "liger": liger,
                     "checkpointing": planned.spec.activation_checkpointing, "stage": planned.spec.stage,
                     "offload_optimizer": planned.spec.offload_optimizer.device,
                     "offload_param": planned.spec.offload_param.device},
        "planned_gpu_allocated_bytes": planned.gpu_allocated_bytes, "planned_gpu_bytes": planned.gpu_bytes,
        "planned_host_bytes": no_save.host_bytes,
        "measured_gpu_peak_allocated_bytes": measured_gpu, "measured_host_peak_minus_start_bytes": host_peak,
        "host_near_peak": {"at_s": host["peak_at_s"], **host["near_peak"]},
        "gpu_ratio": measured_gpu / planned.gpu_allocated_bytes if measured_gpu else None,
        "host_ratio": host_peak / no_save.host_bytes if no_save.host_bytes else None,
        "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"), "mfu": median("mfu"),
        "step_time_s": median("step_time_s"), "ds_step_ms": median("ds_step_ms"), "ds_fwd_ms": median("ds_fwd_ms"),
        "ds_bwd_ms": median("ds_bwd_ms"), "steps_measured": len(steps), "command": cmd,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}_proof.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    return code


def update_train_args(folder: Path, values: dict) -> None:
    """Set TrainingArguments in a recipe folder's train_args.yaml (its comments are not kept: a scratch copy)."""
    path = folder / "train_args.yaml"
    path.write_text(yaml.safe_dump({**(yaml.safe_load(path.read_text()) or {}), **values}, sort_keys=False))


def write_variant(item: str, ours: Path, work: Path) -> str:
    """A copy of our folder with the keys of `NAME=KEY=VALUE,...` changed (VALUE in JSON), bench's NAME=FOLDER: KEY
    is a dotted ds_config key, or `train.ARG` for a TrainingArguments value in train_args.yaml (a micro batch change
    needs both: train.per_device_train_batch_size and train_micro_batch_size_per_gpu)."""
    name, _, changes = item.partition("=")
    folder = work / f"variant-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(ours, folder)
    config = json.loads((folder / "ds_config.json").read_text())
    train_args = {}
    for change in split_changes(changes):
        key, _, value = change.partition("=")
        if key.startswith("train."):
            train_args[key.removeprefix("train.")] = json.loads(value)
            continue
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = json.loads(value)
    (folder / "ds_config.json").write_text(json.dumps(config, indent=2))
    update_train_args(folder, train_args)
    return f"{name}={folder}"


def split_changes(text: str) -> list[str]:
    """`KEY=VALUE,KEY=VALUE` split at the commas outside JSON brackets and strings (a VALUE may be a JSON object)."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(text):
        if char == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and char in "{[":
            depth += 1
        elif not quoted and char in "}]":
            depth -= 1
        elif not quoted and depth == 0 and char == ",":
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]] if text else []


def describe_plan(p) -> str:
    spec = p.spec
    parts = [f"ZeRO-{spec.stage}"]
    if spec.offload_optimizer.device != "none":
        parts.append(f"optimizer on {spec.offload_optimizer.device}")
    if spec.offload_param.device != "none":
        parts.append(f"params on {spec.offload_param.device}")
    if spec.activation_checkpointing:
        parts.append("checkpointing")
    return " + ".join(parts) + f", micro {p.training.micro_batch} x accumulation {p.training.grad_accum}"


if __name__ == "__main__":
    sys.exit(main())
