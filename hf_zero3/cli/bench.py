"""`hf-zero3 bench RECIPE`: the recipe against stock ZeRO-3 / ZeRO-2 / FSDP2, side by side, on one machine."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from hf_zero3.argtypes import positive_float, positive_int


def add_arguments(verbs) -> None:
    """Register `bench` on the `hf-zero3` subparsers."""
    bench = verbs.add_parser("bench", help="benchmark a recipe against stock ZeRO-3 / FSDP2, side by side",
                             epilog="Train overrides for every variant go after --, e.g. -- --block_size 2048")
    bench.add_argument("recipe", help="recipe name (recipes/<name>) or folder")
    bench.add_argument("--steps", type=positive_int, default=10, help="measured steps per variant")
    bench.add_argument("--warmup", type=int, default=3, help="steps excluded from the medians")
    bench.add_argument("--against", default="stock",
                       help="comma-separated baselines: stock, stock_offload, fsdp2 (as documented: checkpointing on, "
                            "the recipe's micro batch) and stock_tuned, zero2_tuned, fsdp2_tuned (tuned by hand: "
                            "no checkpointing, the Trainer's optimizer, the largest micro batch that fits 8B on H200; "
                            "--tuned sets them for another model)")
    bench.add_argument("--tuned", action="append", default=[], metavar="NAME=MICRO[+ckpt]",
                       help="a *_tuned baseline's micro batch, and +ckpt for activation checkpointing, where the 8B "
                            "defaults do not fit, e.g. --tuned stock_tuned=4+ckpt for 13b on 2 x H200. Repeatable; "
                            "several settings of one baseline each run (as NAME_MICRO[_ckpt]) and the report "
                            "compares ours with the best: --tuned stock_tuned=1 --tuned stock_tuned=8+ckpt")
    bench.add_argument("--variant", action="append", default=[], metavar="NAME=FOLDER",
                       help="another recipe folder, run like ours under NAME (repeatable)")
    bench.add_argument("--repeats", type=positive_int, default=1,
                       help="runs per config, interleaved; the report gives medians and each run")
    bench.add_argument("--run-timeout", type=positive_int, default=0, metavar="SECONDS",
                       help="stop a run that takes longer (reported as failed, exit 124, unless it had logged all its "
                            "steps and was only exiting); default: no limit")
    bench.add_argument("--resume", action="store_true",
                       help="skip the runs already recorded in --work-dir (a bench cut short, continued)")
    bench.add_argument("--only", default="", metavar="NAMES",
                       help="comma-separated configs (ours, a --variant, a baseline: all its --tuned settings, or "
                            "one of them as NAME_MICRO[_ckpt]) to run in this call; implies "
                            "--resume, so the others' recorded runs stay in the report (e.g. a third run of two configs)")
    bench.add_argument("--gpus", type=positive_int, help="ranks per variant (default: all GPUs, or 2 on CPU)")
    bench.add_argument("--breakdown", action="store_true",
                       help="DeepSpeed wall-clock breakdown (fwd/bwd/step; adds a sync per timer)")
    bench.add_argument("--peak-tflops", type=positive_float, metavar="TFLOPS",
                       help="one GPU's dense bf16 TFLOP/s, for MFU (default: looked up by GPU name; an unknown GPU "
                            "has no MFU without it)")
    bench.add_argument("--label", help="model name in the report's file name (default: from the model path)")
    bench.add_argument("--suffix", default="",
                       help="appended to the report's file name: <label>_<hardware>_<date>_<suffix>")
    bench.add_argument("--out", default="outputs/bench-report", help="where the report, JSONL and PNG go")
    bench.add_argument("--work-dir", default="outputs/bench", help="where the runs write their outputs")
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from hf_zero3.ops.bench import BASELINES, TUNED_MICRO_BATCH, Tuned, run_bench, tuned_accumulation, tuned_variants
    from hf_zero3.plan.hardware import default_ranks
    from hf_zero3.recipes import RecipeError, get
    from hf_zero3.run.facts import RunFacts
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
    try:
        tuned = Tuned.collect(args.tuned)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if set(tuned) - set(against):
        print(f"error: --tuned sets {sorted(set(tuned) - set(against))}, which --against does not run: add them to "
              "--against", file=sys.stderr)
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
    only = frozenset(a for a in args.only.split(",") if a)
    settings = {name: tuned_variants(name, tuned) for name in against if name in TUNED_MICRO_BATCH}
    names = {"ours", *others, *against, *(variant for pairs in settings.values() for variant, _ in pairs)}
    if only - names:
        print(f"error: --only {args.only}: {sorted(only - names)} not in this bench: name ours, a --variant, a "
              f"baseline given with --against or one of its --tuned settings ({', '.join(sorted(names))})",
              file=sys.stderr)
        return 2
    extra = [*args.overrides, *(["--peak_tflops", str(args.peak_tflops)] if args.peak_tflops else [])]
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
    facts = RunFacts.from_values(values)
    global_batch = facts.global_batch(gpus)
    try:
        for variant, setting in (pair for pairs in settings.values() for pair in pairs):
            tuned_accumulation(variant, setting, global_batch, gpus)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = args.label or recipe.name
    from hf_zero3.plan.shapes import load_config_shape

    shape = load_config_shape(values.get("model_name_or_path") or values.get("config_name"),
                              overrides=values.get("config_overrides"))
    model = (f"{label}: {shape.params:,} parameters ({shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn}, "
             f"{shape.heads} heads / {shape.kv_heads} kv heads, vocab {shape.vocab})")
    # SIGTERM (`timeout`, a scheduler) becomes SystemExit: run_bench's `finally` stops the run in flight
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        report, failed = run_bench(recipe, steps=args.steps, warmup=args.warmup, against=against, gpus=gpus,
                                   out_dir=Path(args.out), work_dir=Path(args.work_dir), extra=extra,
                                   breakdown=args.breakdown, model_label=label, model=model,
                                   seq_len=facts.seq_len, global_batch=global_batch,
                                   command="hf-zero3 " + " ".join(args.argv), repeats=args.repeats, others=others,
                                   resume=args.resume or bool(only), run_timeout=args.run_timeout, suffix=args.suffix,
                                   only=only, tuned=tuned)
    except ValueError as e:  # a scratch folder that is not ours: left untouched
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report}")
    for name, error in failed.items():
        print(f"error: variant {name} failed, so the report has no numbers for it: {error}", file=sys.stderr)
    return 1 if failed else 0
