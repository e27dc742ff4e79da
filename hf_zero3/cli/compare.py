"""`hf-zero3 compare RECIPE`: the same training under DDP and each ZeRO rung; memory, speed and loss side by side."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from hf_zero3.argtypes import positive_int
from hf_zero3.ops.compare import DEFAULT_RUNGS, RUNGS


def add_arguments(verbs) -> None:
    """Register `compare` on the `hf-zero3` subparsers."""
    compare = verbs.add_parser(
        "compare", help="DDP vs ZeRO-1/2/3, checkpointing, offload, NVMe: memory, speed and loss parity",
        epilog="Train overrides for every rung go after --, e.g. -- --bf16 true --block_size 1024")
    compare.add_argument("recipe", help="recipe name (recipes/<name>) or folder")
    compare.add_argument("--rungs", default=",".join(DEFAULT_RUNGS),
                         help=f"comma-separated, in this order: {', '.join(RUNGS)} (ddp_seed2: DDP with another "
                              "data-loader seed, the spread to judge bf16 runs against)")
    compare.add_argument("--steps", type=positive_int, default=20, help="optimizer steps per rung")
    compare.add_argument("--warmup", type=int, default=3, help="steps left out of the tokens/s median")
    compare.add_argument("--gpus", type=positive_int, help="ranks per rung (default: all GPUs, or 2 on CPU)")
    compare.add_argument("--nvme-path", help="folder on a local NVMe mount for the NVMe rung (skipped without it)")
    compare.add_argument("--nvme-steps", type=positive_int, metavar="N",
                         help="optimizer steps of the NVMe rung (default: --steps): each step reads and writes every "
                         "offloaded state on the disk, about 35 GB for a 1.1B model, so a slow disk needs fewer")
    compare.add_argument("--stop-after", type=positive_int, default=0, metavar="N",
                         help="stop each rung of this call after its first N steps of the --steps schedule (the "
                         "learning rate follows the full schedule, so the losses compare step by step with full "
                         "rungs); no held-out evaluation then")
    compare.add_argument("--run-timeout", type=positive_int, default=0, metavar="SECONDS",
                         help="stop a rung that takes longer (reported as failed); default: no limit")
    compare.add_argument("--redo", action="store_true", help="run rungs again that --out already records")
    compare.add_argument("--report-only", action="store_true", help="only rebuild the report from --out/rungs/")
    compare.add_argument("--label", help="the report's file name (default: seed_claims_<recipe>)")
    compare.add_argument("--out", default="outputs/compare", help="where rungs/*.json(l), the report and PNG go")
    compare.add_argument("--work-dir", default="outputs/compare_work",
                         help="the runs' output folders and the initial weights")
    compare.set_defaults(func=_compare)


def _compare(args: argparse.Namespace) -> int:
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.checkpoint.lifecycle import CheckpointError
    from hf_zero3.ops.compare import run_compare, write_report
    from hf_zero3.plan.hardware import default_ranks
    from hf_zero3.plan.shapes import load_config_shape
    from hf_zero3.recipes import RecipeError, get
    from hf_zero3.job.arguments import load_arguments
    from hf_zero3.job.facts import RunFacts

    try:
        recipe = get(args.recipe).folder
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = args.label or f"seed_claims_{recipe.name}"
    if args.report_only:
        if not (Path(args.out) / "rungs").is_dir():
            print(f"error: {args.out}/rungs does not exist: run the ladder first (same --out)", file=sys.stderr)
            return 2
        print(f"wrote {write_report(Path(args.out), label)}")
        return 0
    names = [n for n in args.rungs.split(",") if n]
    yaml_path = recipe / "train_args.yaml"
    try:
        values = load_arguments([str(yaml_path), *args.overrides])
        from hf_zero3.ops.compare import ladder

        ladder(names, on_gpu=False, nvme_path=args.nvme_path)  # unknown rung names fail here, before anything runs
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (values.get("model_name_or_path") or values.get("config_name")):
        print("error: no model: set model_name_or_path or config_name in the recipe or after --", file=sys.stderr)
        return 2
    gpus = args.gpus or default_ranks()
    facts = RunFacts.from_values(values)
    source = values.get("model_name_or_path") or values["config_name"]
    shape = load_config_shape(source, overrides=values.get("config_overrides"))
    meta = {"model": f"{shape.params:,} parameters ({shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn}, "
                     f"{shape.heads} heads / {shape.kv_heads} kv heads, vocab {shape.vocab})",
            "data": f"train {values.get('train_file')}, held out {values.get('validation_file')}",
            "seq_len": facts.seq_len, "global_batch": facts.global_batch(gpus), "gpus": gpus,
            "overrides": args.overrides}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # `timeout`: stop the rung in flight
    try:
        report, failed = run_compare(yaml_path, values, names, steps=args.steps, warmup=args.warmup, gpus=gpus,
                                     out_dir=Path(args.out), work_dir=Path(args.work_dir), extra=args.overrides,
                                     label=label, meta=meta, nvme_path=args.nvme_path, run_timeout=args.run_timeout,
                                     redo=args.redo, nvme_steps=args.nvme_steps, stop_after=args.stop_after)
    except (ValueError, CheckpointError) as e:  # a scratch or staging folder that is not ours: left untouched
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report}")
    for name, error in failed.items():
        print(f"error: rung {name} failed: {error}", file=sys.stderr)
    return 1 if failed else 0
