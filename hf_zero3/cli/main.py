"""`hf-zero3 <verb>`: the parser of every verb (each registered by its own module) and the dispatch."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero3", description="DeepSpeed ZeRO-3 for Hugging Face Trainer")
    verbs = parser.add_subparsers(dest="verb", required=True)

    # train and launch dispatch before the parsers: they skip every verb's imports
    from hf_zero3.cli import bench as bench_cli
    from hf_zero3.cli import checkpoint as checkpoint_cli
    from hf_zero3.cli import compare as compare_cli
    from hf_zero3.cli import config as config_cli
    from hf_zero3.cli import doctor as doctor_cli
    from hf_zero3.cli import plan as plan_cli

    config_cli.add_arguments(verbs)  # config new, config check, configs
    bench_cli.add_arguments(verbs)
    compare_cli.add_arguments(verbs)

    doctor = verbs.add_parser("doctor", help="preflight: versions, ops, GPUs, all-reduce, hosts, NVMe")
    doctor_cli.add_arguments(doctor)
    doctor.set_defaults(func=doctor_cli.main)

    plan = verbs.add_parser("plan", help="memory planner: the cheapest ZeRO configuration that fits your GPUs")
    plan_cli.add_arguments(plan)
    plan.set_defaults(func=plan_cli.main)

    checkpoint_cli.add_arguments(verbs)  # export, reshard, push

    train = verbs.add_parser("train", help="train from a YAML of TrainingArguments (see recipes/)", add_help=False)
    train.set_defaults(func=None)
    launch = verbs.add_parser("launch", help="run a recipe with DeepSpeed's launcher (what recipes/*/launch.sh does)",
                              add_help=False)
    launch.set_defaults(func=None)
    data = verbs.add_parser("data", help="what train would train on: counts and examples with the trained tokens "
                                         "marked (no GPU, no weights)", add_help=False)
    data.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser: HfArgumentParser over the YAML and --key value overrides
        from hf_zero3.run.train import main as train_main  # the Trainer stack: seconds, for train only

        return train_main(argv[1:])
    if argv[:1] == ["data"]:  # train's YAML and overrides, plus --show N and --json
        from hf_zero3.cli.data import main as data_main

        return data_main(argv[1:])
    if argv[:1] == ["launch"]:  # its own parser: a recipe folder, its overrides and the launch environment
        from hf_zero3.run.launch import main as launch_main  # it execs DeepSpeed: no verb parsers

        return launch_main(argv[1:])
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []  # train overrides, passed on verbatim
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.argv, args.overrides = argv, overrides
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
