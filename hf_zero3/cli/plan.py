"""`hf-zero3 plan`: what fits on the GPUs you have, answered before launch (see docs/planner.md).

Prints every option with its memory per GPU, host RAM and NVMe per node, the cheapest that fits, its
breakdown, the TrainingArguments to pass and (with --write-config) its ds_config. `--json` for scripts.
Exit status: 0 when something fits, 1 when nothing does, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_zero3.argtypes import output_file, parse_size, positive_int
from hf_zero3.plan.types import ATTENTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` verb's options."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", help="recipe name (tiny, 7b, 13b, 70b, 8b, ...), config folder or hub id")
    for flag in ("layers", "hidden", "ffn", "heads", "kv-heads", "vocab"):
        model.add_argument(f"--{flag}", type=positive_int, help="override (or, without --model, define) the shape")
    run = parser.add_argument_group("training")
    run.add_argument("--seq-len", type=positive_int,
                     help="tokens per sample (default: the block_size of the recipe --model names, else min(4096, "
                     "the model's max))")
    run.add_argument("--micro-batch", type=positive_int, help="fix the per-GPU batch (default: searched)")
    run.add_argument("--global-batch", type=positive_int,
                     help="samples per optimizer step (default: micro batch x GPUs)")
    run.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    run.add_argument("--attention", choices=ATTENTIONS, default="sdpa")
    run.add_argument("--liger", action=argparse.BooleanOptionalAction, default=None,
                     help="Liger kernels (use_liger_kernel: fused RMSNorm, SwiGLU and linear cross-entropy: no whole "
                     "logits, smaller activations, faster); default: on when liger-kernel is installed here")
    run.add_argument("--from-scratch", action="store_true",
                     help="the model is built from a config (random init, fp32 while loading: with ZeRO-1/2 every "
                     "rank holds 4 B/param of host RAM at start), not loaded from a 16-bit checkpoint")
    run.add_argument("--lora-rank", type=positive_int, metavar="R",
                     help="LoRA of rank R on every linear layer: only the adapter trains, the base is frozen (a "
                     "recipe with a peft: block is planned with its adapter without it)")
    run.add_argument("--lora-dropout", type=float, metavar="P", default=None,
                     help="the adapter's dropout (default: the recipe's peft: block's, else 0.05); each adapted "
                     "layer keeps its own dropped-out input when it is above 0")
    run.add_argument("--stage", choices=("sft", "dpo", "orpo", "simpo", "kto"), default=None,
                     help="training method: dpo/orpo/simpo put chosen and rejected through one forward (twice the "
                     "activations per pair); dpo and kto keep a reference model (a second ZeRO-3 partition, none "
                     "with LoRA or --precompute-ref); default: the stage of the recipe --model names, else sft")
    run.add_argument("--trainer", choices=("trl", "transformers"), default="trl",
                     help="whose loss: trl, the stage's TRL trainer as hf-zero3 train runs it (SFT, DPO, KTO: the "
                     "fused LM head, logits in tiles); transformers, your own Trainer script (the whole fp32 logits, "
                     "or Liger's fused linear cross-entropy)")
    run.add_argument("--precompute-ref", action=argparse.BooleanOptionalAction, default=None,
                     help="the reference's log-probs are precomputed before training (no second model during it); "
                     "default: as the recipe --model names sets stage_args.precompute_ref_log_probs "
                     "(--no-precompute-ref plans a recipe that sets it without)")
    hw = parser.add_argument_group("hardware (default: this machine)")
    hw.add_argument("--hardware", metavar="PROFILE",
                    help="a named machine (hf_zero3/plan/profiles.py: p4d.24xlarge, nd-a100-v4, a2-highgpu-4g, "
                    "dgx-a100-80, dgx-h100, h200x1, h200x2): its GPUs, GPU memory, host RAM and NVMe; the flags "
                    "below override single figures")
    hw.add_argument("--headroom", type=float, default=0.0,
                    help="fraction of GPU memory, host RAM and NVMe to leave free, e.g. 0.1 (default 0)")
    hw.add_argument("--nodes", type=positive_int, default=1)
    hw.add_argument("--gpus", type=positive_int, help="GPUs per node")
    hw.add_argument("--gpu-mem", type=parse_size, help="memory per GPU, e.g. 40GB, 80GiB")
    hw.add_argument("--host-ram", type=parse_size, help="host RAM per node, e.g. 1TB, 512G")
    hw.add_argument("--nvme-path", help="a directory on a local NVMe drive (enables NVMe offload options)")
    hw.add_argument("--nvme-free", type=parse_size, help="free NVMe space per node (default: read at --nvme-path)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--write-config", metavar="PATH", type=output_file, help="write the chosen ds_config here")
    out.add_argument("--plot", metavar="FILE", type=output_file,
                     help="draw each option's memory as stacked bars of its terms against the GPU and host limits "
                          "(a PNG; needs matplotlib)")


def _shape(args: argparse.Namespace):
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.plan.shapes import ModelShape, load_shape, with_changes

    sizes = {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab")
             if getattr(args, k) is not None}
    if args.model:
        return with_changes(load_shape(args.model), **sizes)
    missing = [f"--{k.replace('_', '-')}" for k in ("layers", "hidden", "ffn", "heads", "vocab") if k not in sizes]
    if missing:
        raise ValueError(f"no model: pass --model NAME (tiny, 7b, 13b, 70b, 8b, a recipe, a config folder or hub "
                         f"id) or a full shape (missing {' '.join(missing)})")
    return ModelShape("custom", **{"kv_heads": sizes["heads"], **sizes})


def _liger(flag: bool | None) -> tuple[bool, str]:
    """Whether to plan with Liger, and why: --liger/--no-liger, else whether liger-kernel is installed here."""
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.plan.hardware import versions

    if flag is not None:
        return flag, f"{'on' if flag else 'off'} (--{'' if flag else 'no-'}liger)"
    found = versions().get("liger-kernel")
    if found:
        return True, f"on (liger-kernel {found} installed here; --no-liger plans without it)"
    return False, "off (liger-kernel not installed here; --liger plans for a machine that has it)"


def _hardware(args: argparse.Namespace):
    """A named profile (single figures overridden by the flags), else the flags and this machine."""
    import dataclasses

    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.plan.hardware import detect_hardware
    from hf_zero3.plan.profiles import get

    if not args.hardware:
        hardware = detect_hardware(nodes=args.nodes, gpus_per_node=args.gpus, gpu_mem=args.gpu_mem,
                                   host_ram=args.host_ram, nvme_path=args.nvme_path, nvme_free=args.nvme_free)
        return dataclasses.replace(hardware, headroom=args.headroom)
    hardware = get(args.hardware).hardware(args.nodes, args.headroom, args.nvme_path)
    given = {"gpus_per_node": args.gpus, "gpu_mem": args.gpu_mem, "host_ram": args.host_ram,
             "nvme_free": args.nvme_free}
    return dataclasses.replace(hardware, **{k: v for k, v in given.items() if v is not None})


def _recipe_values(args: argparse.Namespace) -> dict:
    """The YAML of the recipe `--model` names ({} when it names none)."""
    # imported when the verb runs, as in main: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3 import recipes

    recipe = recipes.find(args.model) if args.model else None
    return recipe.values if recipe is not None else {}


def _seq_len(args: argparse.Namespace, shape, recipe: dict) -> int:
    """`--seq-len`, else the block_size of the recipe `--model` names (`recipe`), else min(4096, the model's max)."""
    block_size = recipe.get("block_size")
    return args.seq_len or (int(block_size) if block_size else min(4096, shape.max_positions))


def _adapter(args: argparse.Namespace, shape, recipe: dict):
    """The LoRA adapter to plan: `--lora-rank`, else the `peft:` block of the recipe `--model` names (`recipe`; None:
    every weight trains); `--lora-dropout` sets its dropout. ValueError naming a bad block."""
    # imported when the verb runs, as in main: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.model import lora

    return lora.planned(shape, recipe.get("peft"), args.lora_rank, args.lora_dropout)


def _preference(args: argparse.Namespace, recipe: dict, lora: bool):
    """The stage to plan: `--stage`/`--precompute-ref`, else the recipe's `stage` and `stage_args` (None: SFT)."""
    # imported when the verb runs, as in main: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.plan.preference import preference_of

    precompute = (recipe.get("stage_args") or {}).get("precompute_ref_log_probs")
    return preference_of(args.stage or recipe.get("stage") or "sft", lora=lora,
                         precompute=bool(args.precompute_ref if args.precompute_ref is not None else precompute))


def main(args: argparse.Namespace) -> int:
    """Run `hf-zero3 plan`; returns the exit status."""
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.plan.choose import choose
    from hf_zero3.plan.length import length_json, plan_length, report_lines
    from hf_zero3.plan.report import answer_json, cost_lines, print_choice
    from hf_zero3.plan.shapes import ModelError
    from hf_zero3.plan.types import PlanError

    try:
        shape = _shape(args)
        hardware = _hardware(args)
        recipe = _recipe_values(args)
        seq_len = _seq_len(args, shape, recipe)
        liger, liger_why = _liger(args.liger)
        adapter = _adapter(args, shape, recipe)
        preference = _preference(args, recipe, lora=adapter is not None)
        choice = choose(shape, hardware, seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
                        precision=args.precision, attention=args.attention,
                        load_bytes=4 if args.from_scratch else None, liger=liger, adapter=adapter,
                        preference=preference, trainer=args.trainer)
        length = None if choice.fits else plan_length(
            shape, hardware, seq_len, precision=args.precision, attention=args.attention, liger=liger,
            adapter=adapter, load_bytes=4 if args.from_scratch else None, preference=preference,
            trainer=args.trainer)
    except (ModelError, PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if length is not None and length.best is not None:  # sequence parallelism or tiling makes it fit
        choice = length.best.choice
    if args.write_config and choice.fits and not _write_config(args.write_config, choice):
        return 2
    if args.json:
        answer = answer_json(shape, hardware, seq_len, choice, args.hardware, liger, liger_why)
        print(json.dumps({**answer, "length": length_json(length)}, indent=2))
    else:
        print_choice(shape, hardware, seq_len, choice, liger_why=liger_why)
        for line in report_lines(length, shape, args.precision, args.attention, args.trainer) if length is not None else []:
            print(line)
        for line in cost_lines(choice, args.hardware):
            print(line)
        if choice.fits:
            print(f"ds_config: written to {args.write_config}" if args.write_config else
                  "ds_config: pass --write-config PATH to write it (or --json to see it)")
    if args.plot:
        _plot(args, shape, hardware, seq_len, choice)
    if args.write_config and not choice.fits:
        print(f"error: nothing fits, so no ds_config was written to {args.write_config}", file=sys.stderr)
    return 0 if choice.fits else 1


def _write_config(path: str, choice) -> bool:
    """Write the chosen ds_config to `path`; False (the error printed) when it cannot be written."""
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.config.presets import render

    try:
        Path(path).write_text(render(choice.ds_config))
    except OSError as e:
        print(f"error: cannot write {path}: {e.strerror}: choose a path you can write to", file=sys.stderr)
        return False
    return True


def _plot(args: argparse.Namespace, shape, hardware, seq_len: int, choice) -> None:
    """`--plot FILE`: each option's terms as stacked bars (a note instead when matplotlib is missing)."""
    # imported when the verb runs: every `hf-zero3` call builds all the verbs' parsers
    from hf_zero3.plan.plot import plot_plan
    from hf_zero3.plan.report import rows

    title = (f"{shape.name}: {shape.params / 1e9:.2f}B parameters, sequence {seq_len}, {hardware.nodes} node(s) x "
             f"{hardware.gpus_per_node} GPUs")
    if plot_plan(args.plot, rows(choice), title):
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    else:
        print(f"note: no plot written to {args.plot}: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
