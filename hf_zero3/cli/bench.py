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
                       help="comma-separated baselines: tuned (every no-code switch a competent user flips: "
                            "stock_tuned, zero2_tuned, fsdp2_tuned and, on one GPU, plain_tuned: Liger, the Trainer's "
                            "fused AdamW, checkpointing on and off, each at the best micro batch that fits, searched "
                            "down on out-of-memory), one of those, or the documented setups stock, stock_offload, fsdp2 "
                            "(checkpointing on, the recipe's micro batch, no Liger)")
    bench.add_argument("--tuned", action="append", default=[], metavar="NAME=MICRO[+ckpt]",
                       help="a tuned baseline's settings instead of its default two (checkpointing off and on, each "
                            "searched from the per-rank batch): this one, its search starting at MICRO, e.g. "
                            "--tuned stock_tuned=2 --tuned stock_tuned=8+ckpt where the fit is known. Repeatable")
    bench.add_argument("--variant", action="append", default=[], metavar="NAME=FOLDER",
                       help="another recipe folder, run like ours under NAME (repeatable)")
    bench.add_argument("--repeats", type=positive_int, default=1,
                       help="runs per config, interleaved; the report gives medians and each run")
    bench.add_argument("--run-timeout", type=positive_int, default=0, metavar="SECONDS",
                       help="stop a run that takes longer (reported as failed, exit 124, unless it had logged all its "
                            "steps and was only exiting); default: no limit")
    bench.add_argument("--time-budget", type=positive_int, default=0, metavar="SECONDS",
                       help="start a run only while the time spent plus its expected length (its last run, else "
                            "the longest recorded) fits in SECONDS; the runs left are counted and the same command "
                            "with --resume continues (one bench split over calls of a time-limited machine)")
    bench.add_argument("--resume", action="store_true",
                       help="skip the runs already recorded in --work-dir (a bench cut short, continued)")
    bench.add_argument("--only", default="", metavar="NAMES",
                       help="comma-separated configs (ours, a --variant, a baseline: all its settings, one "
                            "setting as NAME_ckpt or NAME_nockpt, or one run as NAME_MICRO[_ckpt], without search) to "
                            "run in this call; implies "
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
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.ops.bench import run_bench
    from hf_zero3.ops.bench_inputs import bench_inputs

    try:
        given = bench_inputs(args.recipe, against=args.against, gpus=args.gpus, tuned=args.tuned,
                             variants=args.variant, only=args.only, overrides=args.overrides,
                             peak_tflops=args.peak_tflops, label=args.label)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # SIGTERM (`timeout`, a scheduler) becomes SystemExit: run_bench's `finally` stops the run in flight
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        report, failed, left = run_bench(
            given.recipe, steps=args.steps, warmup=args.warmup, against=given.against, gpus=given.gpus,
            out_dir=Path(args.out), work_dir=Path(args.work_dir), extra=given.extra, breakdown=args.breakdown,
            model_label=given.label, model=given.model, seq_len=given.seq_len, global_batch=given.global_batch,
            command="hf-zero3 " + " ".join(args.argv), repeats=args.repeats, others=given.others,
            resume=args.resume or bool(given.only), run_timeout=args.run_timeout, suffix=args.suffix,
            only=given.only, tuned=given.tuned, time_budget=args.time_budget)
    except ValueError as e:  # a scratch folder that is not ours: left untouched
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report}")
    if left:
        print(f"bench: {left} run(s) left for the time budget ({args.time_budget} s): run the same command again "
              f"with --resume (and the same --work-dir) to continue", flush=True)
    else:
        print("bench: all runs done", flush=True)
    for name, error in failed.items():
        print(f"error: variant {name} failed, so the report has no numbers for it: {error}", file=sys.stderr)
    return 1 if failed else 0
