"""`hf-zero3 <verb>`: a thin face over the modules; parsing and dispatch, nothing else."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_zero3.argtypes import int_or_auto, positive_int


def _config_new(args: argparse.Namespace) -> int:
    from hf_zero3.config.build import build_ds_config, training_args_overrides
    from hf_zero3.config.check import load_config
    from hf_zero3.config.convert import spec_from_ds_config
    from hf_zero3.config.presets import STANDALONE_CONFIGS, render
    from hf_zero3.config.spec import ZeroSpec

    notes: list[str] = []
    if args.like:
        try:
            spec, notes = spec_from_ds_config(load_config(args.like), world_size=args.world_size)
        except (FileNotFoundError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            print(f"error: cannot convert {args.like}: {e}\nRun `hf-zero3 config check {args.like}` for every "
                  "finding with its fix", file=sys.stderr)
            return 2
        fields = spec.model_dump(exclude_unset=True)
    elif args.preset:
        fields = STANDALONE_CONFIGS[args.preset].model_dump(exclude_unset=True)
    else:
        fields = {}
    for name in ("stage", "precision", "gradient_clipping", "micro_batch_size", "gradient_accumulation_steps",
                 "global_batch_size", "sub_group_size", "reduce_bucket_size"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    for name in ("offload_optimizer", "offload_param"):
        device = getattr(args, name)
        if device is not None:
            fields[name] = {"device": device, **({"nvme_path": args.nvme_path} if device == "nvme" else {})}
        elif args.nvme_path and fields.get(name, {}).get("device") == "nvme":
            fields[name] = {**fields[name], "nvme_path": args.nvme_path}
    for flag, name in (("activation_checkpointing", "activation_checkpointing"),
                       ("wall_clock_breakdown", "wall_clock_breakdown"),
                       ("overlap_comm", "overlap_comm"), ("contiguous_gradients", "contiguous_gradients"),
                       ("gather_16bit_weights", "gather_16bit_weights_on_save")):
        if getattr(args, flag) is not None:
            fields[name] = getattr(args, flag)
    try:
        spec = ZeroSpec(**fields)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = render(build_ds_config(spec))
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    overrides = training_args_overrides(spec)
    if overrides:
        print("pass with TrainingArguments: " + " ".join(f"--{k} {json.dumps(v) if isinstance(v, dict) else v}"
                                                         for k, v in overrides.items()), file=sys.stderr)
    return 0


def _config_check(args: argparse.Namespace) -> int:
    from hf_zero3.config.check import check_ds_config, has_errors, load_config

    try:
        config = load_config(args.file)
    except (FileNotFoundError, ValueError) as e:
        print(f"ERROR   {e}")
        return 1
    device = args.device
    if device == "auto":
        import torch

        # A login node without GPUs says nothing about where the job runs: skip device checks there.
        device = "cuda" if torch.cuda.is_available() else "any"
    findings = check_ds_config(config, world_size=args.world_size, micro_batch=args.micro_batch,
                               grad_accum=args.grad_accum, device=None if device == "any" else device)
    for finding in findings:
        print(finding)
    errors = sum(f.level == "error" for f in findings)
    print(f"{args.file}: {errors} error(s), {len(findings) - errors} note(s)")
    return 1 if has_errors(findings) else 0


def _configs(args: argparse.Namespace) -> int:
    from hf_zero3.config.presets import stale_configs, write_configs

    root = Path(args.root)
    if args.check:
        stale = stale_configs(root)
        for path in stale:
            print(f"stale: {path} (run `make configs`)")
        return 1 if stale else 0
    for path in write_configs(root):
        print(f"wrote {path}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from hf_zero3.ops.bench import BASELINES, TUNED_MICRO_BATCH, run_bench, tuned_accumulation
    from hf_zero3.plan.hardware import default_ranks
    from hf_zero3.recipes import RecipeError, get
    from hf_zero3.run.train import load_arguments

    try:
        recipe = get(args.recipe).folder
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    against = [a for a in args.against.split(",") if a]
    unknown = [a for a in against if a not in BASELINES]
    if unknown:
        print(f"error: unknown baseline(s) {unknown}: choose from {', '.join(BASELINES)}", file=sys.stderr)
        return 2
    others = {}
    for item in args.variant:
        name, _, folder = item.partition("=")
        if not name or not folder or not (Path(folder) / "train_args.yaml").is_file() or \
                not (Path(folder) / "ds_config.json").is_file() or name == "ours" or name in BASELINES:
            print(f"error: --variant {item}: give NAME=FOLDER, a recipe folder (train_args.yaml + ds_config.json) "
                  "and a name that is not ours or a baseline", file=sys.stderr)
            return 2
        others[name] = Path(folder)
    extra = args.overrides
    try:
        values = load_arguments([str(recipe / "train_args.yaml"), *extra])
        for folder in others.values():
            load_arguments([str(folder / "train_args.yaml"), *extra])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (values.get("model_name_or_path") or values.get("config_name")):
        print("error: no model: set model_name_or_path or config_name in the recipe or after --", file=sys.stderr)
        return 2
    gpus = args.gpus or default_ranks()
    global_batch = values.get("per_device_train_batch_size", 8) * values.get("gradient_accumulation_steps", 1) * gpus
    try:
        for name in against:
            if name in TUNED_MICRO_BATCH:
                tuned_accumulation(name, global_batch, gpus)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = args.label or recipe.name
    from hf_zero3.plan.shapes import load_config_shape

    shape = load_config_shape(values.get("model_name_or_path") or values.get("config_name"),
                              overrides=values.get("config_overrides"))
    model = (f"{label}: {shape.params:,} parameters ({shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn}, "
             f"{shape.heads} heads / {shape.kv_heads} kv heads, vocab {shape.vocab})")
    report, failed = run_bench(recipe, steps=args.steps, warmup=args.warmup, against=against, gpus=gpus,
                               out_dir=Path(args.out), work_dir=Path(args.work_dir), extra=extra,
                               breakdown=args.breakdown, model_label=label, model=model,
                               seq_len=values.get("block_size", 512), global_batch=global_batch,
                               command="hf-zero3 " + " ".join(args.argv), repeats=args.repeats, others=others,
                               resume=args.resume, run_timeout=args.run_timeout, suffix=args.suffix)
    print(f"wrote {report}")
    for name, error in failed.items():
        print(f"error: variant {name} failed, so the report has no numbers for it: {error}", file=sys.stderr)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    from hf_zero3.config.presets import STANDALONE_CONFIGS

    parser = argparse.ArgumentParser(prog="hf-zero3", description="DeepSpeed ZeRO-3 for Hugging Face Trainer")
    verbs = parser.add_subparsers(dest="verb", required=True)

    config = verbs.add_parser("config", help="generate or validate a ds_config").add_subparsers(
        dest="action", required=True)
    new = config.add_parser("new", help="print a ds_config built from options")
    new.add_argument("--like", metavar="FILE", help="start from an existing ds_config (kept intent, fixed errors)")
    new.add_argument("--preset", choices=sorted(STANDALONE_CONFIGS), help="start from a named config")
    new.add_argument("--world-size", type=positive_int, help="with --like: make the implied micro batch explicit")
    new.add_argument("--stage", type=int, choices=[0, 1, 2, 3])
    new.add_argument("--precision", choices=["bf16", "fp16", "fp32", "auto"])
    new.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"])
    new.add_argument("--offload-param", choices=["none", "cpu", "nvme"])
    new.add_argument("--nvme-path", help="directory on a local NVMe mount (for nvme offload)")
    new.add_argument("--micro-batch", dest="micro_batch_size", type=int_or_auto)
    new.add_argument("--grad-accum", dest="gradient_accumulation_steps", type=int_or_auto)
    new.add_argument("--global-batch", dest="global_batch_size", type=int_or_auto)
    new.add_argument("--gradient-clipping", type=float)
    new.add_argument("--sub-group-size", type=positive_int)
    new.add_argument("--reduce-bucket-size", type=int_or_auto)
    for flag in ("activation-checkpointing", "wall-clock-breakdown", "overlap-comm", "contiguous-gradients",
                 "gather-16bit-weights"):
        new.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None)
    new.add_argument("-o", "--output", help="write here instead of stdout")
    new.set_defaults(func=_config_new)

    check = config.add_parser("check", help="validate a ds_config; every finding names its fix")
    check.add_argument("file")
    check.add_argument("--world-size", type=positive_int)
    check.add_argument("--micro-batch", type=positive_int)
    check.add_argument("--grad-accum", type=positive_int)
    check.add_argument("--device", choices=["auto", "cpu", "cuda", "any"], default="auto",
                       help="device the config will run on (auto: cuda if this machine has one, else skip device checks)")
    check.set_defaults(func=_config_check)

    configs = verbs.add_parser("configs", help="write every generated config (ds_configs/, recipes/*/)")
    configs.add_argument("--root", default=".", help="repository root")
    configs.add_argument("--check", action="store_true", help="fail if a committed config is stale")
    configs.set_defaults(func=_configs)

    bench = verbs.add_parser("bench", help="benchmark a recipe against stock ZeRO-3 / FSDP2, side by side",
                             epilog="Train overrides for every variant go after --, e.g. -- --block_size 2048")
    bench.add_argument("recipe", help="recipe name (recipes/<name>) or folder")
    bench.add_argument("--steps", type=positive_int, default=10, help="measured steps per variant")
    bench.add_argument("--warmup", type=int, default=3, help="steps excluded from the medians")
    bench.add_argument("--against", default="stock",
                       help="comma-separated baselines: stock, stock_offload, fsdp2 (as documented: checkpointing on, "
                            "the recipe's micro batch) and stock_tuned, zero2_tuned, fsdp2_tuned (tuned by hand: "
                            "no checkpointing, the Trainer's optimizer, the largest micro batch that fits 8B on H200)")
    bench.add_argument("--variant", action="append", default=[], metavar="NAME=FOLDER",
                       help="another recipe folder, run like ours under NAME (repeatable)")
    bench.add_argument("--repeats", type=positive_int, default=1,
                       help="runs per config, interleaved; the report gives medians and each run")
    bench.add_argument("--run-timeout", type=positive_int, default=0, metavar="SECONDS",
                       help="stop a run that takes longer (reported as failed, exit 124); default: no limit")
    bench.add_argument("--resume", action="store_true",
                       help="skip the runs already recorded in --work-dir (a bench cut short, continued)")
    bench.add_argument("--gpus", type=positive_int, help="ranks per variant (default: all GPUs, or 2 on CPU)")
    bench.add_argument("--breakdown", action="store_true",
                       help="DeepSpeed wall-clock breakdown (fwd/bwd/step; adds a sync per timer)")
    bench.add_argument("--label", help="model name in the report's file name (default: from the model path)")
    bench.add_argument("--suffix", default="",
                       help="appended to the report's file name: <label>_<hardware>_<date>_<suffix>")
    bench.add_argument("--out", default="benchmarks", help="where the report, JSONL and PNG go")
    bench.add_argument("--work-dir", default="outputs/bench", help="where the runs write their outputs")
    bench.set_defaults(func=_bench)

    from hf_zero3.cli import doctor as doctor_cli

    doctor = verbs.add_parser("doctor", help="preflight: versions, ops, GPUs, all-reduce, hosts, NVMe")
    doctor_cli.add_arguments(doctor)
    doctor.set_defaults(func=doctor_cli.main)

    from hf_zero3.cli import plan as plan_cli

    plan = verbs.add_parser("plan", help="memory planner: the cheapest ZeRO configuration that fits your GPUs")
    plan_cli.add_arguments(plan)
    plan.set_defaults(func=plan_cli.main)

    from hf_zero3.cli import checkpoint as checkpoint_cli

    checkpoint_cli.add_arguments(verbs)  # export, reshard, push

    train = verbs.add_parser("train", help="train from a YAML of TrainingArguments (see recipes/)", add_help=False)
    train.set_defaults(func=None)
    launch = verbs.add_parser("launch", help="run a recipe with DeepSpeed's launcher (what recipes/*/launch.sh does)",
                              add_help=False)
    launch.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser: HfArgumentParser over the YAML and --key value overrides
        from hf_zero3.run.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["launch"]:  # its own parser: a recipe folder, its overrides and the launch environment
        from hf_zero3.run.launch import main as launch_main

        return launch_main(argv[1:])
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []  # train overrides, passed on verbatim
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.argv, args.overrides = argv, overrides
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
