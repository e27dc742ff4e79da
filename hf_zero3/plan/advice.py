"""After an out-of-memory error: the planner's next step, as exact overrides (a regenerated ds_config and/or
TrainingArguments), among the options that give up memory on every axis.
"""

from __future__ import annotations

import dataclasses

from hf_zero3.config import batch
from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan import length
from hf_zero3.plan.choose import candidates, choose, offload_level
from hf_zero3.plan.memory import plan
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.types import Hardware, Plan, Training
from hf_zero3.units import gb


def oom_advice(shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec, *,
               host: bool = False, ds_config_path: str | None = None, sequence_parallel: int = 1,
               tiled: bool = False) -> str:
    """The planner's next step after a CUDA OOM (or a host OOM with `host=True`), as exact overrides.

    The run just proved the prediction too low, so only steps that give up memory on every axis are
    considered (same or higher stage and offload, checkpointing kept, micro batch not larger, samples
    per GPU per step unchanged); of those that need less of the exhausted memory and are predicted to
    fit, the cheapest in `cost_key` order is the answer. `training` holds whole sequences; with
    `sequence_parallel` and `tiled` (the run's `sequence_parallel_size`, `tiled_compute`) each rank is planned with
    its share (`length.per_rank`); when nothing more frugal fits the GPUs, the length is what does not fit: the
    answer is more sequence parallelism or tiling, when that fits.
    """
    whole, training = training, length.per_rank(training, sequence_parallel, tiled)
    current = plan(shape, hardware, training, spec)
    what = "host RAM" if host else "GPU memory"
    need = (lambda p: p.host_bytes) if host else (lambda p: p.gpu_bytes)
    same_batch = batch.global_batch(training.micro_batch, training.grad_accum, hardware.world_size)
    options = [p for p in candidates(shape, hardware, training.seq_len, global_batch=same_batch,
                                     precision=spec.precision, attention=training.attention, liger=training.liger,
                                     load_bytes=training.load_bytes, adapter=training.adapter,
                                     preference=training.preference, trainer=training.trainer)
               if _at_least_as_frugal(p, current, host) and need(p) < need(current)]
    nxt = next((p for p in options if p.fits), None)
    head = (f"hf_zero3: out of {what}. Planned for this run: {gb(need(current))} ({current.label}, "
            f"micro batch {training.micro_batch}).")
    if nxt is None and not host:  # a preference stage is offered tiling only (`length.plan_length`)
        step = _length_step(shape, hardware, whole, current, (sequence_parallel, tiled), ds_config_path)
        if step:
            return f"{head} {step}"
    if nxt is None:
        choice = choose(shape, hardware, training.seq_len, precision=spec.precision, attention=training.attention,
                        liger=training.liger, load_bytes=training.load_bytes, adapter=training.adapter,
                        preference=training.preference, trainer=training.trainer)
        return f"{head} No more frugal option is predicted to fit. {choice.advice}".strip()
    return (f"{head} Next step (predicted {gb(need(nxt))}: {nxt.label}, micro batch {nxt.training.micro_batch}): "
            f"{_how(current, nxt, ds_config_path)}")


def _length_step(shape: ModelShape, hardware: Hardware, whole: Training, current: Plan, now: tuple[int, bool],
                 ds_config_path: str | None) -> str:
    """More sequence parallelism or tiling that fits one sequence of the run's length, as overrides; "" when none
    does."""
    found = length.plan_length(shape, hardware, whole.seq_len, precision=current.spec.precision,
                               attention=whole.attention, liger=whole.liger, adapter=whole.adapter,
                               load_bytes=whole.load_bytes, preference=whole.preference, trainer=whole.trainer,
                               beyond=now).best
    if found is None:
        return ""
    config_only = dataclasses.replace(found.choice.plan, training=current.training)  # the ds_config's changes only
    parts = [f"--sequence_parallel_size {found.sp}"] if found.sp != now[0] else []
    parts += ["--tiled_compute true"] if found.tiled and not now[1] else []
    parts += [p for p in [_how(current, config_only, ds_config_path)] if p]
    parts += [p for p in [_batch_for_length(current.training, found, now[0])] if p]
    more, grows = found.sp // max(now[0], 1), ("accumulation" if found.choice.plan.training.micro_batch ==
                                                  current.training.micro_batch else "samples per rank")
    note = (f" (each sequence split over {found.sp} ranks: {hardware.world_size // found.sp} data-parallel, so the "
            f"same global batch needs {more}x the {grows})" if found.sp != now[0] else "")
    return (f"The sequence ({whole.seq_len} tokens) is what does not fit: predicted {gb(found.choice.plan.gpu_bytes)} "
            f"with {found.label}, {found.choice.plan.label}: {'; '.join(parts)}{note}")


def _batch_for_length(run: Training, found: length.LengthOption, sp_now: int) -> str:
    """The micro batch the length step was planned at (`plan_length`: 1) and the accumulation that keeps the run's
    global batch over the data-parallel ranks `found.sp` leaves (sp / the run's sp fewer); "" when both stay."""
    micro = found.choice.plan.training.micro_batch
    accum = run.grad_accum * run.micro_batch * (found.sp // max(sp_now, 1)) // micro
    if micro != run.micro_batch:
        return (f"--per_device_train_batch_size {micro} --gradient_accumulation_steps {accum} "
                f"(same global batch; the prediction is at micro batch {micro})")
    return f"--gradient_accumulation_steps {accum} (same global batch)" if accum != run.grad_accum else ""


def _at_least_as_frugal(p: Plan, current: Plan, host: bool = False) -> bool:
    """Gives up memory on every axis; after a host OOM a smaller partial-offload ratio also counts (it moves
    optimizer states from the host to the GPU, and the plan must still fit the GPU)."""
    a, b = p.spec, current.spec
    less_on_host = host and a.offload_optimizer.device == b.offload_optimizer.device == "cpu" and (
        a.offload_param.device == b.offload_param.device)
    return (a.stage >= b.stage and (offload_level(a) >= offload_level(b) or less_on_host)
            and a.activation_checkpointing >= b.activation_checkpointing
            and (a.checkpointed_layers or p.shape.layers) >= (b.checkpointed_layers or p.shape.layers)
            and a.activation_offload >= b.activation_offload
            and p.training.micro_batch <= current.training.micro_batch)


def _how(current: Plan, nxt: Plan, ds_config_path: str | None) -> str:
    """The exact change from `current` to `nxt`: a regenerated ds_config and/or TrainingArguments overrides."""
    parts = []
    a, b = current.spec, nxt.spec
    if (a.stage, a.offload_optimizer, a.offload_param) != (b.stage, b.offload_optimizer, b.offload_param):
        cmd = ["hf-zero3 config new", f"--like {ds_config_path}" if ds_config_path else f"--precision {b.precision}",
               f"--stage {b.stage}"]
        offloads = (("optimizer", b.offload_optimizer), ("param", b.offload_param))
        cmd += [f"--offload-{which} {o.device}" for which, o in offloads if o.device != "none"]
        cmd += [f"--offload-ratio {b.offload_optimizer.ratio:g}"] if b.offload_optimizer.ratio < 1 else []
        unpinned = b.offload_optimizer.device != "none" and not b.offload_optimizer.pin_memory
        cmd += ["--no-pin-memory"] if unpinned else []
        nvme = b.offload_optimizer.nvme_path or b.offload_param.nvme_path
        cmd += [f"--nvme-path {nvme}"] if nvme else []
        parts.append(f"`{' '.join(cmd)} -o ds_config.planned.json`, "
                     "then train with --deepspeed ds_config.planned.json")
    if b.activation_checkpointing and not a.activation_checkpointing:
        parts.append("--gradient_checkpointing true")
    if a.checkpointed_layers != b.checkpointed_layers and b.activation_checkpointing:
        parts.append(f"--gradient_checkpointing_layers {b.checkpointed_layers or 'null'}")
    if b.activation_offload and not a.activation_offload:
        parts.append("--activation_offload true")
    if nxt.training.micro_batch != current.training.micro_batch:
        parts.append(f"--per_device_train_batch_size {nxt.training.micro_batch} "
                     f"--gradient_accumulation_steps {nxt.training.grad_accum} (same global batch)")
    return "; ".join(parts)
