"""`hf-zero3 plan`: what fits on the GPUs you have, answered before launch (see docs/planner.md).

Prints every option with its memory per GPU, host RAM and NVMe per node, the cheapest that fits, its
breakdown, the TrainingArguments to pass and (with --write-config) its ds_config. `--json` for scripts.
Exit status: 0 when something fits, 1 when nothing does, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes from '40GB' (decimal), '80GiB' (binary) or '512G' (binary, as in `free -g` and Slurm)."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(ib|b)?", text.strip().lower())
    if not match or (not match.group(2) and match.group(3) != "b"):
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: give a number with a unit, e.g. 40GB (10^9 bytes), 80GiB or 512G (2^30 bytes)")
    number, prefix, suffix = float(match.group(1)), match.group(2), match.group(3)
    base = 1000 if suffix == "b" else 1024
    return int(number * base ** _UNITS[prefix])


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` verb's options."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", help="named shape (tiny, 7b, 13b, 70b, 8b), recipe name, config folder or hub id")
    for flag in ("layers", "hidden", "ffn", "heads", "kv-heads", "vocab"):
        model.add_argument(f"--{flag}", type=_positive, help="override (or, without --model, define) the shape")
    run = parser.add_argument_group("training")
    run.add_argument("--seq-len", type=_positive, help="tokens per sample (default: min(4096, the model's max))")
    run.add_argument("--micro-batch", type=_positive, help="fix the per-GPU batch (default: searched)")
    run.add_argument("--global-batch", type=_positive,
                     help="samples per optimizer step (default: micro batch x GPUs)")
    run.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    run.add_argument("--attention", choices=["sdpa", "flash_attention_2", "eager"], default="sdpa")
    run.add_argument("--liger", action="store_true",
                     help="Liger kernels (use_liger_kernel: fused RMSNorm, SwiGLU and linear cross-entropy: no whole "
                     "logits, smaller activations)")
    run.add_argument("--from-scratch", action="store_true",
                     help="the model is built from a config (random init, fp32 while loading: with ZeRO-1/2 every "
                     "rank holds 4 B/param of host RAM at start), not loaded from a 16-bit checkpoint")
    hw = parser.add_argument_group("hardware (default: this machine)")
    hw.add_argument("--nodes", type=_positive, default=1)
    hw.add_argument("--gpus", type=int, help="GPUs per node")
    hw.add_argument("--gpu-mem", type=parse_size, help="memory per GPU, e.g. 40GB, 80GiB")
    hw.add_argument("--host-ram", type=parse_size, help="host RAM per node, e.g. 1TB, 512G")
    hw.add_argument("--nvme-path", help="a directory on a local NVMe drive (enables NVMe offload options)")
    hw.add_argument("--nvme-free", type=parse_size, help="free NVMe space per node (default: read at --nvme-path)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--write-config", metavar="PATH", help="write the chosen ds_config here")


def _shape(args: argparse.Namespace):
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


def _rows(choice) -> list:
    """One row per option (stage, offload, checkpointing): its largest fitting micro batch, else its smallest."""
    rows: dict = {}
    for p in choice.tried:  # cheapest first, so within an option the largest micro batch comes first
        spec = p.spec
        key = (spec.stage, spec.offload_optimizer.device, spec.offload_param.device, spec.activation_checkpointing)
        if key not in rows or not rows[key].fits:
            rows[key] = p
    return list(rows.values())


PHASE_TAGS = {"always": "", "backward": " [backward]", "step": " [optimizer step]"}
"""GPU terms of one phase never coexist with the other's: the total counts the larger phase only."""


def _terms_json(plan) -> dict:
    return {where: [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "kind": t.kind,
                     **({"allocator": t.allocator, "phase": t.phase} if where == "gpu" else {})} for t in terms]
            for where, terms in plan.breakdown.items()}


def _plan_json(p) -> dict:
    return {"option": p.label, "stage": p.spec.stage, "offload_optimizer": p.spec.offload_optimizer.device,
            "offload_param": p.spec.offload_param.device, "checkpointing": p.spec.activation_checkpointing,
            "micro_batch": p.training.micro_batch, "grad_accum": p.training.grad_accum,
            "gpu_bytes": p.gpu_bytes, "gpu_allocated_bytes": p.gpu_allocated_bytes, "host_bytes": p.host_bytes,
            "nvme_bytes": p.nvme_bytes, "fits": p.fits, "problems": p.problems(), "notes": list(p.notes)}


def _shown(choice):
    """The plan whose breakdown is shown: the choice, else the first that fits the GPUs, else the most frugal."""
    return choice.plan or next((p for p in choice.tried if p.fits_gpu), None) or min(
        choice.tried, key=lambda p: p.gpu_bytes)


def _print_tables(shape, hardware, seq_len, choice, out) -> None:
    from hf_zero3.plan.memory import gb

    detected = f" (read from this machine: {', '.join(hardware.detected)})" if hardware.detected else ""
    host = f"{gb(hardware.host_ram)}/node" if hardware.host_ram else "not given (not checked; pass --host-ram)"
    nvme = f"{gb(hardware.nvme_free)} free at {hardware.nvme_path}" if hardware.nvme_path else "none (--nvme-path)"
    out(f"model     {shape.name}: {shape.params / 1e9:.2f}B params (L{shape.layers} H{shape.hidden} ffn{shape.ffn} "
        f"heads{shape.heads} kv{shape.kv_heads} vocab{shape.vocab}), seq {seq_len}")
    out(f"hardware  {hardware.nodes} node(s) x {hardware.gpus_per_node} GPUs x {gb(hardware.gpu_mem)}; host RAM "
        f"{host}; NVMe {nvme}{detected}")
    out("")
    out(f"{'option, cheapest first':68} {'micro x acc':>11} {'per GPU':>10} {'host/node':>12} {'NVMe/node':>10}"
        "  fits")
    for p in _rows(choice):
        fits = "yes" if p.fits else "no: " + ", ".join(x.split(" needs")[0] for x in p.problems())
        out(f"{p.label:68} {p.training.micro_batch:>5} x {p.training.grad_accum:<4}{gb(p.gpu_bytes):>10} "
            f"{gb(p.host_bytes):>12} {gb(p.nvme_bytes):>10}  {fits}")
    out("")
    shown = _shown(choice)
    if choice.fits:
        t = shown.training
        out(f"choice    {shown.label}: micro batch {t.micro_batch} x accumulation {t.grad_accum} x "
            f"{hardware.world_size} GPUs = global batch {t.micro_batch * t.grad_accum * hardware.world_size}")
        if hardware.host_ram is None:
            out(f"          needs {gb(shown.host_bytes)} host RAM per node (not checked: pass --host-ram)")
    else:
        out(f"result    {choice.advice}")
        out(f"closest   {shown.label} (micro batch {shown.training.micro_batch}): " + "; ".join(shown.problems()))
    for note in shown.notes:
        out(f"note      {note}")
    if "gpu_mem" not in hardware.detected and hardware.gpu_mem % 10**9 == 0:
        size = hardware.gpu_mem // 10**9
        out(f"note      {size}GB is {size} x 10^9 bytes; a GPU sold as {size}GB has about {size} GiB "
            f"({size * 2**30 / 1e9:.1f} GB, what torch reports): pass --gpu-mem {size}GiB to plan for all of it")
    limits = {"gpu": ("per GPU", hardware.gpu_mem), "host": ("host RAM per node", hardware.host_ram),
              "nvme": ("NVMe per node", hardware.nvme_free)}
    for where, terms in shown.breakdown.items():
        if not any(t.bytes for t in terms):
            continue
        title, limit = limits[where]
        out("")
        out(f"{title + (f' (of {gb(limit)})' if limit else ''):54} {'GB':>9}  formula")
        for term in terms:
            name = term.name + PHASE_TAGS[term.phase] if where == "gpu" else term.name
            out(f"  {name:52} {term.bytes / 1e9:9.2f}  {term.formula}")
        extra = ""
        if where == "gpu":
            extra = (f"  held throughout + the {PHASE_TAGS[shown.peak_phase].strip()} terms (the larger phase); "
                     f"torch.cuda.max_memory_allocated predicted: {gb(shown.gpu_allocated_bytes)}")
        out(f"  {'total':52} {shown.total(where) / 1e9:9.2f}{extra}")


def _shell(value) -> str:
    """A TrainingArguments value as typed on a command line."""
    if isinstance(value, dict):
        return "'" + json.dumps(value) + "'"
    return str(value).lower() if isinstance(value, bool) else str(value)


def main(args: argparse.Namespace) -> int:
    """Run `hf-zero3 plan`; returns the exit status."""
    from hf_zero3.config.presets import render
    from hf_zero3.plan.memory import PlanError, choose, detect_hardware
    from hf_zero3.plan.shapes import ModelError

    try:
        if args.gpus is not None and args.gpus < 1:
            raise PlanError(f"--gpus must be >= 1 (got {args.gpus}): pass the GPUs per node you plan for")
        shape = _shape(args)
        hardware = detect_hardware(nodes=args.nodes, gpus_per_node=args.gpus, gpu_mem=args.gpu_mem,
                                   host_ram=args.host_ram, nvme_path=args.nvme_path, nvme_free=args.nvme_free)
        seq_len = args.seq_len or min(4096, shape.max_positions)
        choice = choose(shape, hardware, seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
                        precision=args.precision, attention=args.attention,
                        load_bytes=4 if args.from_scratch else None, liger=args.liger)
    except (ModelError, PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.write_config and choice.fits:
        Path(args.write_config).write_text(render(choice.ds_config))
    if args.json:
        shown = _shown(choice)
        print(json.dumps({
            "model": {"name": shape.name, "params": shape.params, "layers": shape.layers, "hidden": shape.hidden,
                      "ffn": shape.ffn, "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab},
            "seq_len": seq_len,
            "hardware": {"nodes": hardware.nodes, "gpus_per_node": hardware.gpus_per_node,
                         "gpu_mem": hardware.gpu_mem, "host_ram": hardware.host_ram,
                         "nvme_path": hardware.nvme_path, "nvme_free": hardware.nvme_free,
                         "detected": list(hardware.detected)},
            "fits": choice.fits,
            "choice": _plan_json(choice.plan) if choice.fits else None,
            "ds_config": choice.ds_config if choice.fits else None,
            "training_args": choice.training_args if choice.fits else None,
            "advice": choice.advice,
            "breakdown_of": _plan_json(shown),
            "breakdown": _terms_json(shown),
            "options": [_plan_json(p) for p in _rows(choice)],
        }, indent=2))
    else:
        _print_tables(shape, hardware, seq_len, choice, print)
        if choice.fits:
            print()
            print("TrainingArguments: " + " ".join(
                f"--{k} {_shell(v)}"
                for k, v in choice.training_args.items()))
            print(f"ds_config: written to {args.write_config}" if args.write_config else
                  "ds_config: pass --write-config PATH to write it (or --json to see it)")
    if args.write_config and not choice.fits:
        print(f"error: nothing fits, so no ds_config was written to {args.write_config}", file=sys.stderr)
    return 0 if choice.fits else 1
