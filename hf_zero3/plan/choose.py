"""The chooser: every configuration the planner considers, cheapest first, and the fastest that fits, with its
ds_config and TrainingArguments, answered before launch instead of by OOM and retry.

`choose()` walks the options from fastest to most frugal (`cost_key`), sizing each with the memory model
(`plan.memory.plan`) and deciding between stages that both fit by measured speed (`plan.speed`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from hf_zero3.config import batch
from hf_zero3.config.build import build_ds_config, training_args_overrides
from hf_zero3.config.presets import STANDALONE_CONFIGS
from hf_zero3.config.spec import EVERY_PARAMETER, ZeroSpec
from hf_zero3.plan.memory import gathers_are_views, plan
from hf_zero3.plan.partitions import gpu_kept_optimizer_elements, rank_partitions
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.speed import faster_measured, fastest
from hf_zero3.plan.types import Adapter, Attention, Hardware, Plan, PlanError, Preference, Training
from hf_zero3.units import gb

PARTIAL_OFFLOAD_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""The `offload_optimizer.ratio` values the chooser tries (ZeRO-3, cpu): the least offload that fits wins."""


def _rungs(hardware: Hardware, precision: str, params: int) -> list[ZeroSpec]:
    """The configurations considered (each also with checkpointing, and with checkpointing + activation offload);
    `cost_key` orders them."""
    z2, z3, opt, both = (STANDALONE_CONFIGS[n].model_dump(exclude_unset=True)
                         for n in ("zero2", "zero3", "zero3_offload_optimizer", "zero3_offload_all"))
    specs = [z2, z3, opt, both]
    specs += [{**opt, "offload_optimizer": {"device": "cpu", "ratio": r, "pin_memory": pin}}
              for pin in (True, False) for r in PARTIAL_OFFLOAD_RATIOS]
    specs += [{**opt, "offload_optimizer": {"device": "cpu", "pin_memory": False}}]
    if hardware.nvme_path:
        nvme = {"device": "nvme", "nvme_path": hardware.nvme_path}
        small = {"sub_group_size": 100_000_000}  # NVMe swap buffers are sized by the sub-group
        specs += [{**opt, **small, "offload_optimizer": nvme}, {**both, **small, "offload_optimizer": nvme},
                  {**both, **small, "offload_optimizer": nvme, "offload_param": nvme}]
    specs = [ZeroSpec(**{**s, "precision": precision}) for s in specs]
    return [_one_gpu(s, params) if gathers_are_views(s, hardware) else s for s in specs]


ONE_GPU_BUCKETS = {"reduce_bucket_size": 500_000_000, "overlap_comm": False}
"""ZeRO-3 on one GPU without offload: gradients in 5e8-element buckets (at most the model's size: DeepSpeed allocates
the whole bucket), without the side stream. A one-rank reduce-scatter is a copy, there is nothing to overlap, and
"auto" (hidden²) makes ~400 of them per micro-step. On a 7B that ran 1.06x, +0.9 GiB, one run each
(benchmarks study ckpt-micro-7b-1gpu). Not with optimizer offload: there the side stream overlaps the
gradient copies to the host, which bound that step (unmeasured)."""


def _one_gpu(spec: ZeroSpec, params: int) -> ZeroSpec:
    """ZeRO-3 on one GPU with its parameters there: every parameter persists (free there, and it skips the per-module
    fetch: 1.33x on a 7B, EVERY_PARAMETER), and without offload the ONE_GPU_BUCKETS."""
    lean = {**ONE_GPU_BUCKETS, "reduce_bucket_size": min(ONE_GPU_BUCKETS["reduce_bucket_size"], params)}
    lean = lean if spec.offload_optimizer.device == "none" else {}
    return ZeroSpec(**{**spec.model_dump(exclude_unset=True), "param_persistence_threshold": EVERY_PARAMETER, **lean})


def offload_level(spec: ZeroSpec) -> tuple[float, float]:
    """Less is faster: none 0, cpu its ratio (partial offload between none and all), nvme 2; optimizer + params."""
    rank = {"none": 0, "cpu": 1, "nvme": 2}
    opt, prm = rank[spec.offload_optimizer.device], rank[spec.offload_param.device]
    if spec.offload_optimizer.device == "cpu":
        opt = spec.offload_optimizer.ratio
    return opt + prm, opt


def tier_key(p: Plan) -> tuple:
    """The memory tier: less offload, then no recomputation, then activations kept on the GPU, then pinned host
    buffers (faster copies), then saves that gather a loadable 16-bit model (without: ZeRO shards, which
    `hf-zero3 export` turns into one after training); within a tier, measured speed decides (`plan.speed`)."""
    return (offload_level(p.spec), p.spec.activation_checkpointing, p.spec.activation_offload,
            not p.spec.offload_optimizer.pin_memory, not p.spec.gather_16bit_weights_on_save)


def _with_checkpointing(key: tuple) -> tuple:
    """`tier_key` of the same tier with checkpointing on (activations still on the GPU)."""
    return (key[0], True, False, *key[3:])


def cost_key(p: Plan) -> tuple:
    """Expected speed order: less offload, then no recomputation, then lower stage, then fewer checkpointed layers,
    then larger micro batch."""
    layers = p.spec.checkpointed_layers or (p.shape.layers if p.spec.activation_checkpointing else 0)
    return (*tier_key(p), p.spec.stage, layers, -p.training.micro_batch)


def is_partial(p: Plan) -> bool:
    """Checkpointing on only the first layers (`fewest_checkpointed`)."""
    return p.spec.checkpointed_layers is not None


MICRO_BATCH_SEARCH = (64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1)
"""Micro batches tried when no global batch is given (largest first): the largest that fits fills the GPU."""


def micro_batches(hardware: Hardware, global_batch: int | None, micro_batch: int | None) -> list[tuple[int, int]]:
    """(micro batch, accumulation) pairs that reach the global batch, largest micro batch first."""
    if global_batch is None:
        return [(micro_batch, 1)] if micro_batch else [(m, 1) for m in MICRO_BATCH_SEARCH]
    per_rank = batch.per_rank(global_batch, hardware.world_size)
    if per_rank is None:
        raise PlanError(f"global batch {global_batch} is not a multiple of {hardware.world_size} GPUs: use a "
                        f"multiple such as {max(1, round(global_batch / hardware.world_size)) * hardware.world_size}")
    if micro_batch is not None:
        accum = batch.accumulation(global_batch, micro_batch, hardware.world_size)
        if accum is None:
            raise PlanError(f"micro batch {micro_batch} does not divide the {per_rank} samples per GPU of global "
                            f"batch {global_batch}: use a divisor of {per_rank}")
        return [(micro_batch, accum)]
    return [(m, accum) for m in range(per_rank, 0, -1)
            if (accum := batch.accumulation(global_batch, m, hardware.world_size)) is not None]


def candidates(shape: ModelShape, hardware: Hardware, seq_len: int, *, global_batch: int | None = None,
               micro_batch: int | None = None, precision: str = "bf16", attention: Attention = "sdpa",
               load_bytes: int | None = None, liger: bool = False, adapter: Adapter | None = None,
               preference: Preference | None = None, trainer: str = "trl") -> list[Plan]:
    """Every configuration the planner considers, cheapest first (`adapter`, `preference`, `trainer`: see
    `Training`)."""
    plans, kept_seen = [], set()
    for rung in _rungs(hardware, precision, shape.params):
        if rung.offload_optimizer.ratio < 1:  # a ratio that keeps no more sub-groups than a smaller one adds nothing
            trains = adapter.params if adapter is not None else shape.params
            partitions = None if adapter is not None else rank_partitions(shape, hardware.world_size)
            kept = gpu_kept_optimizer_elements(rung, math.ceil(trains / hardware.world_size), partitions)[0]
            key = (kept, rung.offload_optimizer.pin_memory)
            if kept == 0 or key in kept_seen:
                continue
            kept_seen.add(key)
        gathers = (True, False) if rung.stage == 3 else (True,)
        for checkpointing, offload, gather in itertools.product((False, True), (False, True), gathers):
            if offload and not checkpointing:
                continue
            for micro, accum in micro_batches(hardware, global_batch, micro_batch):
                spec = ZeroSpec(**{**rung.model_dump(exclude_unset=True), "activation_checkpointing": checkpointing,
                                   "activation_offload": offload, "gather_16bit_weights_on_save": gather,
                                   "micro_batch_size": micro, "gradient_accumulation_steps": accum,
                                   "global_batch_size": batch.global_batch(micro, accum, hardware.world_size)})
                training = Training(seq_len, micro, accum, attention, load_bytes, liger, adapter, preference, trainer)
                plans.append(plan(shape, hardware, training, spec))
                if checkpointing and not offload:
                    plans += [p for p in [fewest_checkpointed(shape, hardware, training, spec)] if p is not None]
    return sorted(plans, key=cost_key)


def fewest_checkpointed(shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec) -> Plan | None:
    """`spec` with checkpointing on only as many layers as it takes to fit (`gradient_checkpointing_layers`: the
    others keep their activations and skip their recompute); None when all layers must be checkpointed to fit, or
    none need be. Memory falls as layers are checkpointed, so a bisection finds the fewest."""
    def with_layers(n: int) -> Plan:
        return plan(shape, hardware, training, spec.model_copy(update={"checkpointed_layers": n}))

    low, high = 1, shape.layers - 1  # invariant: the answer, if any, is in [low, high]
    unneeded = plan(shape, hardware, training, spec.model_copy(update={"activation_checkpointing": False})).fits
    if unneeded or high < low or not with_layers(high).fits:
        return None
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if with_layers(mid).fits else (mid + 1, high)
    return with_layers(low)


@dataclass(frozen=True)
class Choice:
    """The cheapest plan that fits (or None), every option tried, and what would fit if nothing does."""

    plan: Plan | None
    tried: tuple[Plan, ...]
    advice: str = ""
    ds_config: dict = field(default_factory=dict)
    training_args: dict = field(default_factory=dict)
    speed: str = ""
    """Why this option among those of its memory tier: measured speed (with the benchmark file) or memory order."""

    @property
    def fits(self) -> bool:
        return self.plan is not None


def choose(shape: ModelShape, hardware: Hardware, seq_len: int, *, global_batch: int | None = None,
           micro_batch: int | None = None, precision: str = "bf16", attention: Attention = "sdpa",
           load_bytes: int | None = None, liger: bool = False, speed_table: tuple | None = None,
           adapter: Adapter | None = None, preference: Preference | None = None, trainer: str = "trl") -> Choice:
    """The fastest fitting configuration, with its ds_config and TrainingArguments overrides: the least offload, no
    checkpointing unless needed or measured faster (`plan.speed.faster_measured`), each stage at its largest fitting
    micro batch, and between ZeRO-2 and ZeRO-3 the one measured faster (`plan.speed.fastest`). A plan that fits only
    tightly (`Plan.tight`) is chosen only when no plan fits with the full margin.

    `load_bytes`: see `Training.load_bytes` (4 when the model is built from a config); `liger`: `Training.liger`;
    `speed_table`: measurements to decide by (default `plan.speed.MEASURED`); `adapter`: `Training.adapter`;
    `trainer`: `Training.trainer` (whose loss: TRL's fused LM head, or transformers' whole logits)."""
    kwargs = {"global_batch": global_batch, "micro_batch": micro_batch, "precision": precision,
              "attention": attention, "load_bytes": load_bytes, "liger": liger, "adapter": adapter,
              "preference": preference, "trainer": trainer}
    tried = candidates(shape, hardware, seq_len, **kwargs)
    whole = [p for p in tried if not is_partial(p)]
    fitting = [p for p in whole if p.fits and not p.tight] or [p for p in whole if p.fits]
    if fitting:
        table = () if speed_table is None else (speed_table,)
        tier = [p for p in fitting if tier_key(p) == tier_key(fitting[0])]
        best, why = fastest(tier, shape, hardware, seq_len, *table)
        recompute = [p for p in fitting if tier_key(p) == _with_checkpointing(tier_key(best))]
        if recompute and not best.spec.activation_checkpointing:
            other, _ = fastest(recompute, shape, hardware, seq_len, *table)
            best, why = faster_measured(best, other, shape, hardware, seq_len, *table) or (best, why)
        best, why = _fewer_checkpointed(best, why, tried, shape, hardware, seq_len, table)
        best = _with_offload_hint(best, tried)
        args = {**training_args_overrides(best.spec), **({"use_liger_kernel": True} if liger else {})}
        return Choice(best, tuple(tried), "", build_ds_config(best.spec), args, why)
    return Choice(None, tuple(tried), _nothing_fits(shape, hardware, seq_len, tried, **kwargs))


def _fewer_checkpointed(best: Plan, why: str, tried: list[Plan], shape: ModelShape, hardware: Hardware,
                        seq_len: int, table: tuple) -> tuple[Plan, str]:
    """The same option (stage, offload) checkpointing only the layers it must, at the micro batch where that is fewest
    first, when one benchmark file measured it faster than the choice: against whole checkpointing it recomputes
    less; against none it fits a larger micro batch. Either can win or lose (a smaller micro batch pays more
    per-micro-step costs, recompute costs compute): only a measurement decides (`faster_measured`)."""
    if best.spec.activation_offload:
        return best, why
    same = lambda p: tier_key(p) == _with_checkpointing(tier_key(best)) and p.spec.stage == best.spec.stage
    for p in sorted((p for p in tried if is_partial(p) and p.fits and same(p)), key=cost_key):
        measured = faster_measured(best, p, shape, hardware, seq_len, *table)
        if measured is not None and measured[0] is p:
            return measured
    return best, why


def _with_offload_hint(best: Plan, tried: list[Plan]) -> Plan:
    """The chosen plan, with a note when activation offload would let a larger micro batch fit the same option."""
    if best.spec.activation_offload or not best.spec.activation_checkpointing:
        return best
    same = lambda p: (p.spec.stage, p.spec.offload_optimizer, p.spec.offload_param,
                      p.spec.gather_16bit_weights_on_save) == (best.spec.stage, best.spec.offload_optimizer,
                                                               best.spec.offload_param,
                                                               best.spec.gather_16bit_weights_on_save)
    larger = [p for p in tried if p.spec.activation_offload and same(p) and p.fits and not p.tight
              and p.training.micro_batch > best.training.micro_batch]
    if not larger:
        return best
    top = max(larger, key=lambda p: p.training.micro_batch)
    return dataclasses.replace(best, notes=(*best.notes, (
        f"with activation offload (--activation_offload true) micro batch {top.training.micro_batch} fits "
        f"({gb(top.gpu_bytes)} per GPU, {gb(top.host_bytes)} host RAM per node): fewer, larger steps, PCIe copies "
        "overlapped with compute")))


def _nothing_fits(shape: ModelShape, hardware: Hardware, seq_len: int, tried: list[Plan], **kwargs) -> str:
    host = f" with {gb(hardware.host_ram)} host RAM per node" if hardware.host_ram else ""
    lines = [(f"nothing fits {shape.name} on {hardware.nodes} node(s) x {hardware.gpus_per_node} GPUs of "
              f"{gb(hardware.gpu_mem)}{host}.")]
    on_gpu = next((p for p in tried if p.fits_gpu), None)
    if on_gpu is not None:
        lines.append(f"{on_gpu.label} (micro batch {on_gpu.training.micro_batch}) fits the GPUs but "
                     + "; ".join(on_gpu.problems()) + ".")
    else:
        frugal = min(tried, key=lambda p: p.gpu_bytes)
        lines.append(f"The most frugal option, {frugal.label} (micro batch {frugal.training.micro_batch}), needs "
                     f"{gb(frugal.gpu_bytes)} per GPU and {gb(frugal.host_bytes)} host RAM per node.")
    for nodes in range(hardware.nodes + 1, 8 * hardware.nodes + 65):
        bigger = Hardware(nodes, hardware.gpus_per_node, hardware.gpu_mem, hardware.host_ram, hardware.nvme_path,
                          hardware.nvme_free, headroom=hardware.headroom, fixed=hardware.fixed)
        options = candidates(shape, bigger, seq_len, **{**kwargs, "global_batch": None, "micro_batch": 1})
        fit = next((p for p in options if p.fits), None)
        if fit is not None:
            lines.append(f"It would fit on {nodes} nodes ({nodes * hardware.gpus_per_node} GPUs of "
                         f"{gb(hardware.gpu_mem)}) with {fit.label} (micro batch 1): {gb(fit.gpu_bytes)} per GPU, "
                         f"{gb(fit.host_bytes)} host RAM per node.")
            break
    if not hardware.nvme_path:
        lines.append("With a local NVMe drive, pass --nvme-path DIR to consider ZeRO-Infinity (NVMe offload).")
    return " ".join(lines)
