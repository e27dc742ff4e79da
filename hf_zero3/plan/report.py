"""The planner's answer as people and scripts read it: the options table, the breakdown, the JSON, the overrides.

Shared by `hf-zero3 plan` and the launcher's dry run, which ask the planner with objects and print the same.
"""

from __future__ import annotations

import json

from hf_zero3.config import batch
from hf_zero3.plan.memory import element_bytes
from hf_zero3.plan.profiles import get, nvme_seconds_per_step
from hf_zero3.plan.saves import save_size
from hf_zero3.units import GB, gb


def rows(choice) -> list:
    """One row per option (stage, offload with its ratio and pinning, checkpointing, activation offload): its largest
    micro batch that fits with the full margin, else its largest that fits tightly, else its smallest."""
    rows: dict = {}
    for p in choice.tried:  # cheapest first, so within an option the largest micro batch comes first
        spec = p.spec
        key = (spec.stage, spec.offload_optimizer.device, spec.offload_optimizer.ratio,
               spec.offload_optimizer.pin_memory, spec.offload_param.device, spec.activation_checkpointing,
               spec.activation_offload)
        rank = 2 if p.fits and not p.tight else 1 if p.fits else 0
        if key not in rows or rank > rows[key][0]:
            rows[key] = (rank, p)
    return [p for _, p in rows.values()]
    return list(rows.values())


PHASE_TAGS = {"always": "", "backward": " [backward]", "step": " [optimizer step]", "startup": " [start-up]"}
"""GPU terms of one phase never coexist with the other's: the total counts the larger phase only."""


def terms_json(plan) -> dict:
    return {where: [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "kind": t.kind,
                     **({"allocator": t.allocator, "phase": t.phase} if where == "gpu" else
                        {"phase": t.phase} if where == "host" else {})} for t in terms]
            for where, terms in plan.breakdown.items()}


def plan_json(p) -> dict:
    return {"option": p.label, "stage": p.spec.stage, "offload_optimizer": p.spec.offload_optimizer.device,
            "offload_optimizer_ratio": p.spec.offload_optimizer.ratio,
            "offload_optimizer_pin_memory": p.spec.offload_optimizer.pin_memory,
            "offload_param": p.spec.offload_param.device, "checkpointing": p.spec.activation_checkpointing,
            "activation_offload": p.spec.activation_offload,
            "micro_batch": p.training.micro_batch, "grad_accum": p.training.grad_accum,
            "gpu_bytes": p.gpu_bytes, "gpu_allocated_bytes": p.gpu_allocated_bytes, "host_bytes": p.host_bytes,
            "nvme_bytes": p.nvme_bytes, "fits": p.fits, "problems": p.problems(), "notes": list(p.notes)}


def shown_plan(choice):
    """The plan whose breakdown is shown: the choice, else the first that fits the GPUs, else the most frugal."""
    return choice.plan or next((p for p in choice.tried if p.fits_gpu), None) or min(
        choice.tried, key=lambda p: p.gpu_bytes)


def print_tables(shape, hardware, seq_len, choice, out, liger_why: str = "") -> None:
    """The whole answer: the model and hardware planned for, every option, the choice, its notes, its breakdown."""
    _print_inputs(shape, hardware, seq_len, out)
    _print_options(choice, out)
    shown = shown_plan(choice)
    _print_choice(shown, hardware, choice, out, liger_why)
    _print_breakdown(shown, hardware, out)


def _print_inputs(shape, hardware, seq_len, out) -> None:
    """The model and the hardware planned for (and which figures were read from this machine)."""
    detected = f" (read from this machine: {', '.join(hardware.detected)})" if hardware.detected else ""
    host = f"{gb(hardware.host_ram)}/node" if hardware.host_ram else "not given (not checked; pass --host-ram)"
    free = "unknown space" if hardware.nvme_free is None else f"{gb(hardware.nvme_free)} free"
    nvme = f"{free} at {hardware.nvme_path}" if hardware.nvme_path else "none (--nvme-path)"
    width = (f"{shape.experts} experts of ffn{shape.expert_ffn}, top-{shape.experts_per_token}" if shape.experts
             else f"ffn{shape.ffn}")
    out(f"model     {shape.name}: {shape.params / 1e9:.2f}B params (L{shape.layers} H{shape.hidden} {width} "
        f"heads{shape.heads} kv{shape.kv_heads} vocab{shape.vocab}), seq {seq_len}")
    if shape.experts:
        out(f"experts   {shape.active_params / 1e9:.2f}B active per token: FLOPs and MFU count those; memory counts all "
            f"{shape.params / 1e9:.2f}B. Each MoE layer's block ({shape.expert_block_params() / 1e6:,.0f}M params) is "
            "a ZeRO-3 leaf, gathered whole")
    out(f"hardware  {hardware.nodes} node(s) x {hardware.gpus_per_node} GPUs x {gb(hardware.gpu_mem)}; host RAM "
        f"{host}; NVMe {nvme}{detected}")
    out("")


def _print_options(choice, out) -> None:
    """Every option tried, cheapest first, with its memory and whether it fits."""
    out(f"{'option, cheapest first':68} {'micro x acc':>11} {'per GPU':>10} {'host/node':>12} {'NVMe/node':>10}"
        "  fits")
    for p in rows(choice):
        fits = ("yes, tight" if p.tight else "yes") if p.fits else "no: " + ", ".join(
            x.split(" needs")[0] for x in p.problems())
        out(f"{p.label:68} {p.training.micro_batch:>5} x {p.training.grad_accum:<4}{gb(p.gpu_bytes):>10} "
            f"{gb(p.host_bytes):>12} {gb(p.nvme_bytes):>10}  {fits}")
    out("")


def _print_choice(shown, hardware, choice, out, liger_why: str) -> None:
    """The choice and its batch math (or what is closest and why nothing fits), the saves, Liger and the notes."""
    if choice.fits:
        t, sp = shown.training, choice.training_args.get("sequence_parallel_size", 1)
        ranks = batch.data_parallel(hardware.world_size, sp)  # a sequence-parallel group shares each sequence
        who = f"{hardware.world_size} GPUs" if sp == 1 else \
            f"{ranks} data-parallel ranks ({hardware.world_size} GPUs / sequence parallel {sp})"
        out(f"choice    {shown.label}: micro batch {t.micro_batch} x accumulation {t.grad_accum} x {who} = global "
            f"batch {batch.global_batch(t.micro_batch, t.grad_accum, ranks)}")
        if hardware.host_ram is None:
            out(f"          needs {gb(shown.host_bytes)} host RAM per node (not checked: pass --host-ram)")
        if choice.speed:
            out(f"speed     {choice.speed}")
    else:
        out(f"result    {choice.advice}")
        out(f"closest   {shown.label} (micro batch {shown.training.micro_batch}): " + "; ".join(shown.problems()))
    out(f"saves     {saves_line(shown, hardware)}")
    if liger_why:
        out(f"liger     {liger_why}")
    for note in shown.notes:
        out(f"note      {note}")
    if "gpu_mem" not in hardware.detected and hardware.gpu_mem % GB == 0:
        size = hardware.gpu_mem // GB
        out(f"note      {size}GB is {size} x 10^9 bytes; a GPU sold as {size}GB has about {size} GiB "
            f"({size * 2**30 / 1e9:.1f} GB, what torch reports): pass --gpu-mem {size}GiB to plan for all of it")


def _print_breakdown(shown, hardware, out) -> None:
    """The shown plan's terms per GPU, host RAM and NVMe, each against its limit, with the totals."""
    limits = {"gpu": ("per GPU", hardware.gpu_mem), "host": ("host RAM per node", hardware.host_ram),
              "nvme": ("NVMe per node", hardware.nvme_free)}
    for where, terms in shown.breakdown.items():
        if not any(t.bytes for t in terms):
            continue
        title, limit = limits[where]
        out("")
        out(f"{title + (f' (of {gb(limit)})' if limit else ''):54} {'GB':>9}  formula")
        for term in terms:
            name = term.name + PHASE_TAGS[term.phase] if where in ("gpu", "host") else term.name
            out(f"  {name:52} {term.bytes / 1e9:9.2f}  {term.formula}")
        extra = ""
        if where == "gpu":
            extra = (f"  held throughout + the {PHASE_TAGS[shown.peak_phase].strip()} terms (the larger phase); "
                     f"torch.cuda.max_memory_allocated predicted: {gb(shown.gpu_allocated_bytes)}")
        elif where == "host" and shown.host_phase_total("startup"):
            extra = (f"  the larger of the [start-up] terms ({gb(shown.host_phase_total('startup'))}) and the rest "
                     f"({gb(shown.host_phase_total('always'))})")
        out(f"  {'total':52} {shown.total(where) / 1e9:9.2f}{extra}")


def saves_line(plan, hardware) -> str:
    """What each checkpoint and the final model write, against the disk the profile names: a checkpoint larger
    than that disk means output_dir must go on another volume (`hf-zero3 train` refuses to start otherwise)."""
    spec, lora = plan.spec, plan.training.trainable is not None  # LoRA saves only the adapter, always gathered
    gathered = spec.stage != 3 or spec.gather_16bit_weights_on_save or lora
    checkpoint, final = save_size(plan.training.trainable or plan.shape.params, element_bytes(spec.precision),
                                  {"zero_optimization": {"stage": spec.stage}}, "AdamW", gathered)
    line = (f"a checkpoint {gb(checkpoint.total)} (fp32 weights + Adam moments"
            + (", 16-bit weights" if gathered else "") + f"{' of the adapter' if lora else ''}), the final "
            f"{'adapter' if lora else 'model'} {gb(final.total)}"
            + ("" if gathered else " (ZeRO shards: hf-zero3 export writes the HF folder)"))
    disk = hardware.nvme_free
    if disk and hardware.nodes == 1 and checkpoint.total > disk - plan.nvme_bytes:
        line += (f"; more than the {gb(max(disk - plan.nvme_bytes, 0))} left on the disk at {hardware.nvme_path}: put "
                 "output_dir on a larger volume")
    return line


def shell_value(value) -> str:
    """A TrainingArguments value as typed on a command line."""
    if isinstance(value, dict):
        return "'" + json.dumps(value) + "'"
    return str(value).lower() if isinstance(value, bool) else str(value)


def print_choice(shape, hardware, seq_len, choice, out=print, liger_why: str = "") -> None:
    """The tables, then the TrainingArguments of the choice as command-line overrides."""
    print_tables(shape, hardware, seq_len, choice, out, liger_why)
    if choice.fits:
        out("")
        out("TrainingArguments: " + " ".join(f"--{k} {shell_value(v)}" for k, v in choice.training_args.items()))
        if "gradient_checkpointing_layers" in choice.training_args:
            n = choice.training_args["gradient_checkpointing_layers"]
            out(f"  (gradient_checkpointing_layers is hf-zero3 train's; in your own Trainer script drop it and add "
                f"trainer.add_callback(hf_zero3.callbacks.PartialCheckpointingCallback({n})))")


def answer_json(shape, hardware, seq_len, choice, profile: str | None, liger: bool, liger_why: str) -> dict:
    """`plan --json`: the model, the hardware, the choice with its ds_config and TrainingArguments, every option."""
    shown = shown_plan(choice)
    return {
        "model": {"name": shape.name, "params": shape.params, "layers": shape.layers, "hidden": shape.hidden,
                  "ffn": shape.ffn, "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab},
        "seq_len": seq_len,
        "hardware": {"nodes": hardware.nodes, "gpus_per_node": hardware.gpus_per_node,
                     "gpu_mem": hardware.gpu_mem, "host_ram": hardware.host_ram,
                     "nvme_path": hardware.nvme_path, "nvme_free": hardware.nvme_free,
                     "profile": profile, "headroom": hardware.headroom,
                     "detected": list(hardware.detected)},
        "fits": choice.fits,
        "liger": liger,
        "liger_why": liger_why,
        "speed": choice.speed,
        "choice": plan_json(choice.plan) if choice.fits else None,
        "ds_config": choice.ds_config if choice.fits else None,
        "training_args": choice.training_args if choice.fits else None,
        "advice": choice.advice,
        "breakdown_of": plan_json(shown),
        "breakdown": terms_json(shown),
        "options": [plan_json(p) for p in rows(choice)],
    }


def cost_lines(choice, profile: str | None) -> list[str]:
    """What the choice costs in time beyond the GPUs' work: NVMe swap per step on a named machine (`profile`), and
    unpinned host buffers."""
    lines = []
    if profile and choice.fits and choice.plan.nvme_bytes:
        machine = get(profile)
        lines.append(f"cost      NVMe swap: about {nvme_seconds_per_step(choice.plan.nvme_bytes, machine):,.0f} s per "
                     f"optimizer step at {machine.name}'s {machine.nvme_read_gbps:g} GB/s read, "
                     f"{machine.nvme_write_gbps:g} GB/s write (estimates unless measured; raise accumulation to "
                     "spread it)")
    offload = choice.plan.spec.offload_optimizer if choice.fits else None
    if offload and offload.device == "cpu" and not offload.pin_memory:
        lines.append("cost      host buffers not pinned (the pinned variant does not fit the host RAM): every "
                     "micro-step copies the offloaded gradients to the host from pageable memory, synchronously, so "
                     "fewer micro-steps are faster: the largest micro batch the GPU takes (pass --micro-batch), and "
                     "where the node's RAM allows, pin_memory: true (its row above gives the host RAM it needs)")
    return lines
