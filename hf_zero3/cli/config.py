"""`hf-zero3 config new|check` and `hf-zero3 configs`: generate, validate and regenerate ds_configs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_zero3.argtypes import int_or_auto, output_file, positive_int
from hf_zero3.config.presets import STANDALONE_CONFIGS


def add_arguments(verbs) -> None:
    """Register `config new`, `config check` and `configs` on the `hf-zero3` subparsers."""
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
    new.add_argument("--offload-ratio", type=float, metavar="R",
                     help="partial optimizer offload (ZeRO-3, cpu): the fraction of optimizer sub-groups on the CPU")
    new.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=None,
                     help="page-locked host buffers for the offloaded optimizer (--no-pin-memory: torch rounds each "
                     "pinned block up to a power of 2)")
    new.add_argument("--micro-batch", dest="micro_batch_size", type=int_or_auto)
    new.add_argument("--grad-accum", dest="gradient_accumulation_steps", type=int_or_auto)
    new.add_argument("--global-batch", dest="global_batch_size", type=int_or_auto)
    new.add_argument("--gradient-clipping", type=float)
    new.add_argument("--sub-group-size", type=positive_int)
    new.add_argument("--reduce-bucket-size", type=int_or_auto)
    for flag in ("activation-checkpointing", "activation-offload", "wall-clock-breakdown", "overlap-comm", "contiguous-gradients",
                 "gather-16bit-weights"):
        new.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None)
    new.add_argument("-o", "--output", type=output_file, help="write here instead of stdout (a new file, or --force)")
    new.add_argument("--force", action="store_true", help="with -o: replace an existing file")
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


def _problems(error: ValueError) -> list[str]:
    """A spec's validation error as one line per problem, without pydantic's type names and links."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return [str(error)]
    return [(".".join(map(str, e["loc"])) + ": " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
            + ("" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})") for e in error.errors()]


def _config_new(args: argparse.Namespace) -> int:
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.config.build import build_ds_config, training_args_overrides
    from hf_zero3.config.presets import render
    from hf_zero3.config.spec import SETTINGS, ZeroSpec, changed_fields

    started = _starting_fields(args)
    if started is None:
        return 2
    fields, notes = started
    flags = {"gather_16bit_weights_on_save": "gather_16bit_weights"}
    try:
        fields = changed_fields(fields, {name: getattr(args, flags.get(name, name)) for name in SETTINGS},
                                {name: getattr(args, name) for name in ("offload_optimizer", "offload_param")},
                                args.nvme_path, {"ratio": args.offload_ratio, "pin_memory": args.pin_memory})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        spec = ZeroSpec(**fields)
    except ValueError as e:
        print("\n".join(f"error: {line}" for line in _problems(e)), file=sys.stderr)
        return 2
    if not _write(args, render(build_ds_config(spec))):
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    overrides = training_args_overrides(spec)
    if overrides:
        print("pass with TrainingArguments: " + " ".join(f"--{k} {json.dumps(v) if isinstance(v, dict) else v}"
                                                         for k, v in overrides.items()), file=sys.stderr)
    return 0


def _starting_fields(args: argparse.Namespace) -> tuple[dict, list[str]] | None:
    """The fields `config new` starts from (`--like`'s converted, a `--preset`'s, or none) and the conversion's notes;
    None (the error printed) when `--like` cannot be converted."""
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.config.check import load_config
    from hf_zero3.config.convert import spec_from_ds_config

    if args.like:
        try:
            spec, notes = spec_from_ds_config(load_config(args.like), world_size=args.world_size)
        except (FileNotFoundError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            print(f"error: cannot convert {args.like}: {'; '.join(_problems(e))}\nRun `hf-zero3 config check "
                  f"{args.like}` for every finding with its fix", file=sys.stderr)
            return None
        return spec.model_dump(exclude_unset=True), notes
    if args.preset:
        return STANDALONE_CONFIGS[args.preset].model_dump(exclude_unset=True), []
    return {}, []


def _write(args: argparse.Namespace, text: str) -> bool:
    """The config to `-o` (a new file, or `--force`), else stdout; False (the error printed) when it cannot be."""
    if not args.output:
        sys.stdout.write(text)
        return True
    if Path(args.output).exists() and not args.force:
        print(f"error: {args.output} exists: choose a new path, or pass --force to replace it", file=sys.stderr)
        return False
    try:
        Path(args.output).write_text(text)
    except OSError as e:
        print(f"error: cannot write {args.output}: {e.strerror}: choose a path you can write to", file=sys.stderr)
        return False
    print(f"wrote {args.output}", file=sys.stderr)
    return True


def _config_check(args: argparse.Namespace) -> int:
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
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
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
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
