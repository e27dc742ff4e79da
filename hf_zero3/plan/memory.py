"""Memory planner: what a ZeRO configuration needs per GPU, per node (host RAM) and on NVMe, and the
cheapest configuration that fits, answered before launch instead of by OOM and retry.

`plan()` is pure arithmetic over dataclasses (no CUDA calls), so a GPU run can compare
`plan(...).gpu_allocated_bytes` with `torch.cuda.max_memory_allocated()`. `choose()` walks the options
from fastest to most frugal and returns the first that fits; `oom_advice()` names the next step after
an OOM. Every term, its formula and where it differs from DeepSpeed's estimator: docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from hf_zero3.config.build import build_ds_config, training_args_overrides
from hf_zero3.config.presets import STANDALONE_CONFIGS
from hf_zero3.config.spec import EVERY_PARAMETER, ZeroSpec
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.speed import fastest, faster_measured

GB = 10**9
CUDA_CONTEXT_BYTES = 3 * GB
"""CUDA context, NCCL communicator buffers, kernels: GPU memory the torch allocator never sees. Measured as NVML
used minus torch reserved on 2 x H200: 2.3-2.8 GB (benchmarks study memory-probe-8b); more ranks mean more NCCL
buffers."""
GPU_MARGIN = {3: 0.15, 2: 0.25, 1: 0.25, 0: 0.25}
"""Allocator fragmentation (reserved minus allocated) as a fraction of what is allocated, by ZeRO stage. Measured
on 2 x H200 (benchmarks study memory-probe-8b): ZeRO-3 7-16% (21% with param offload), ZeRO-2 17-26% (its step
makes and frees partition-sized copies of the gradients, which fragment the cache)."""
GPU_MARGIN_NEAR_FULL = {3: 0.07}
"""The fragmentation a nearly full GPU still needs, by ZeRO stage. Close to capacity the caching allocator releases
its free cached blocks and retries before it fails, so less is held back: ZeRO-3 runs at 119-123 GiB allocated of
140 GiB reserved 4.8% and 6.8% more (benchmarks study 8b-tuned). A plan whose full margin does
not fit but this one does gets the memory the GPU leaves (labelled so). Not measured for ZeRO-1/2: no such rule."""
HOST_PER_RANK_BYTES = int(6.5 * GB)
"""Resident memory of one training process beyond what it holds for the model: Python, torch, CUDA, NCCL and
DeepSpeed. Measured with offload on 2 x H200: 5.7-6.1 GiB per rank (benchmarks study memory-probe-8b)."""
HOST_MARGIN = 0.05
"""Headroom on the host total (allocator, OS); the terms themselves are measured, so it is small."""
STARTUP_RANK_BYTES = 1_280_000_000
"""A rank's host memory at rest before its first step (CUDA, torch, DeepSpeed loaded): 13.74 GiB at the 7b's start-up
peak less its 12.55 GiB of 16-bit partitions (benchmarks study recipes-proof-7b-1gpu)."""
LOGITS_BYTES_PER_VOCAB = 12
"""Per token and vocabulary entry at cross-entropy's backward: fp32 log-softmax output kept for backward,
its incoming gradient and the fp32 gradient of the logits (transformers upcasts logits to fp32)."""

OFFLOAD_IN_FLIGHT_LAYERS = 3
"""Activation offload (hf_zero3.run.activation_offload): checkpointed layer inputs on the GPU at once in backward,
the one in use and the two prefetched (its PREFETCH_FACTOR); without checkpointing, about one layer's tensors.
Measured on 2 x H200 (benchmarks study activation-offload): ~4 at the peak by the per-token
slopes, 8 KiB/token more than planned, inside the plan's over-estimate of the peak (+2% to +9%): kept at 3."""
PCIE_BYTES_PER_S = 25 * GB
"""Pinned host<->GPU copy rate per GPU assumed for the PCIe time of activation offload (PCIe 4.0 x16 measures
~25 GB/s, 5.0 ~50): the copies overlap compute on side streams, so this is what the step must be longer than."""

Attention = Literal["sdpa", "flash_attention_2", "eager"]
ATTENTIONS: tuple[str, ...] = Attention.__args__
"""The attention kernels the planner models (sdpa and flash keep O(seq) per head, eager the seq x seq scores)."""


class PlanError(ValueError):
    """Inputs the planner cannot work with; the message names the fix."""


@dataclass(frozen=True)
class FixedTerms:
    """The planner's terms that are not arithmetic over the model but properties of a machine type and its software:
    measured per machine type by a memory probe (`hf_zero3/plan/measured.json`'s `fixed_terms` holds them, with the
    report of the probe that measured each, or says "estimate")."""

    cuda_context: int = CUDA_CONTEXT_BYTES
    """GPU bytes outside torch's allocator: CUDA context, NCCL buffers, kernels (NVML used - torch reserved)."""
    host_per_rank: int = HOST_PER_RANK_BYTES
    """Resident host bytes of one training process beyond what it holds for the model."""
    gpu_margin: tuple[tuple[int, float], ...] = tuple(GPU_MARGIN.items())
    """Fragmentation (reserved / allocated - 1) by ZeRO stage."""
    gpu_margin_near_full: tuple[tuple[int, float], ...] = tuple(GPU_MARGIN_NEAR_FULL.items())
    source: str = "measured on 2 x H200 (benchmarks study memory-probe-8b)"


@dataclass(frozen=True)
class Hardware:
    """The machines to plan for. Sizes in bytes; host RAM and NVMe are per node."""

    nodes: int
    gpus_per_node: int
    gpu_mem: int
    host_ram: int | None
    """None: unknown, so not checked (the plan still reports what it needs)."""
    nvme_path: str | None = None
    nvme_free: int | None = 0
    """None: unknown (the NVMe directory is on the training nodes, not here), so not checked."""
    detected: tuple[str, ...] = ()
    """Which fields were read from this machine rather than given (shown, so nobody plans a cluster
    with a laptop's RAM by accident)."""
    headroom: float = 0.0
    """Fraction of GPU memory, host RAM and NVMe a plan must leave free to fit (0.1: use at most 90%)."""
    fixed: FixedTerms = FixedTerms()
    """This machine type's fixed terms (default: the 2 x H200 probe's)."""

    def __post_init__(self):
        problems = []
        if self.nodes < 1:
            problems.append(f"nodes must be >= 1 (got {self.nodes}): pass --nodes N")
        if self.gpus_per_node < 1:
            problems.append(f"GPUs per node must be >= 1 (got {self.gpus_per_node}): pass --gpus N")
        if self.gpu_mem <= 0:
            problems.append("GPU memory must be > 0: pass --gpu-mem SIZE (e.g. 40GB, 80GiB)")
        if self.host_ram is not None and self.host_ram <= 0:
            problems.append("host RAM must be > 0: pass --host-ram SIZE (e.g. 512GiB)")
        if not 0 <= self.headroom < 1:
            problems.append(f"headroom must be in [0, 1) (got {self.headroom}): pass --headroom 0.1 for 10%")
        if problems:
            raise PlanError("; ".join(problems))

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def usable(self, capacity: int) -> int:
        """What a plan may use of `capacity` (GPU memory, host RAM or NVMe) after the headroom."""
        return int(capacity * (1 - self.headroom))


@dataclass(frozen=True)
class Training:
    """What one optimizer step processes on each GPU."""

    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    attention: Attention = "sdpa"
    """sdpa and flash_attention_2 keep O(seq) per head; eager keeps the seq x seq scores."""
    load_bytes: int | None = None
    """Bytes per parameter as the weights are loaded on the host: None = the training precision (a pretrained
    16-bit checkpoint); 4 for a model built from a config (from scratch: transformers initializes in fp32)."""
    liger: bool = False
    """Liger kernels (`use_liger_kernel`): RMSNorm keeps its 16-bit input and an fp32 rstd per row, SwiGLU keeps
    gate and up and recomputes the activation, and the fused linear cross-entropy never holds the whole logits."""

    def __post_init__(self):
        for name in ("seq_len", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.load_bytes not in (None, 2, 4):
            raise PlanError(f"load_bytes must be 2 or 4 (got {self.load_bytes})")
        if self.attention not in ATTENTIONS:
            raise PlanError(f"attention must be sdpa, flash_attention_2 or eager (got {self.attention!r})")

    @property
    def tokens(self) -> int:
        """Tokens in one micro batch: what the activations scale with."""
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class Term:
    """One line of the breakdown: bytes per GPU (`where="gpu"`) or per node (host, nvme)."""

    name: str
    where: Literal["gpu", "host", "nvme"]
    bytes: int
    formula: str
    kind: Literal["state", "buffer", "activation", "overhead"] = "state"
    """state: params, grads, master weights, optimizer (what DeepSpeed's estimator models); the rest are not."""
    allocator: bool = True
    """GPU terms only: False for memory `torch.cuda.max_memory_allocated` does not count."""
    phase: Literal["always", "backward", "step", "startup"] = "always"
    """GPU terms: "always" is held throughout; "backward" (activations, gathered parameters) and "step" (the optimizer
    step's fp32 gradients) never coexist, so the peak is always + the larger of the two. Host terms: "always", or
    "startup" (before the first step, when no offloaded state exists yet): the host peak is the larger sum."""


@dataclass(frozen=True)
class Plan:
    """The memory a configuration needs, term by term, and whether it fits the hardware."""

    shape: ModelShape
    hardware: Hardware
    training: Training
    spec: ZeroSpec
    terms: tuple[Term, ...]
    notes: tuple[str, ...] = ()

    def total(self, where: str) -> int:
        """Bytes needed at `where`; on the GPU, at the peak: only the larger phase counts (`phase_total`); on the
        host, the larger of start-up and the rest of the run."""
        if where == "host":
            return max(self.host_phase_total("always"), self.host_phase_total("startup"))
        if where != "gpu":
            return sum(t.bytes for t in self.terms if t.where == where)
        return self.gpu_allocated_bytes + sum(t.bytes for t in self.terms if t.where == "gpu" and not t.allocator)

    def host_phase_total(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if t.where == "host" and t.phase == phase)

    def phase_total(self, phase: str) -> int:
        """Allocator-visible GPU bytes of one phase ("always", "backward" or "step")."""
        return sum(t.bytes for t in self.terms if t.where == "gpu" and t.allocator and t.phase == phase)

    @property
    def peak_phase(self) -> str:
        """The phase at which the GPU peaks: "backward" or "step"."""
        return "step" if self.phase_total("step") > self.phase_total("backward") else "backward"

    def model_states(self, where: str) -> int:
        """Params, grads, master weights and optimizer states at `where`: what DeepSpeed's estimator models."""
        return sum(t.bytes for t in self.terms if t.where == where and t.kind == "state")

    @property
    def gpu_bytes(self) -> int:
        """Everything one GPU needs, context and margin included: compare with its memory."""
        return self.total("gpu")

    @property
    def gpu_allocated_bytes(self) -> int:
        """The prediction of `torch.cuda.max_memory_allocated()` on one rank: always + the larger phase."""
        return self.phase_total("always") + max(self.phase_total("backward"), self.phase_total("step"))

    @property
    def host_bytes(self) -> int:
        return self.total("host")

    @property
    def nvme_bytes(self) -> int:
        return self.total("nvme")

    @property
    def breakdown(self) -> dict[str, list[Term]]:
        return {w: [t for t in self.terms if t.where == w] for w in ("gpu", "host", "nvme")}

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_bytes <= self.hardware.usable(self.hardware.gpu_mem)

    @property
    def tight(self) -> bool:
        """It fits only with the near-full fragmentation allowance (`GPU_MARGIN_NEAR_FULL`), not the full margin."""
        return any(n.startswith("tight fit:") for n in self.notes)

    @property
    def fits_host(self) -> bool:
        return self.hardware.host_ram is None or self.host_bytes <= self.hardware.usable(self.hardware.host_ram)

    @property
    def fits_nvme(self) -> bool:
        hw = self.hardware
        return self.nvme_bytes == 0 or (bool(hw.nvme_path) and (
            hw.nvme_free is None or self.nvme_bytes <= hw.usable(hw.nvme_free)))

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host and self.fits_nvme

    @property
    def label(self) -> str:
        return describe(self.spec)

    def problems(self) -> list[str]:
        """Why it does not fit, one line per resource."""
        hw, out = self.hardware, []
        room = f" less {hw.headroom:.0%} headroom" if hw.headroom else ""
        if not self.fits_gpu:
            out.append(f"GPU needs {gb(self.gpu_bytes)} of {gb(hw.gpu_mem)}{room}")
        if not self.fits_host:
            out.append(f"host RAM needs {gb(self.host_bytes)} per node of {gb(hw.host_ram)}{room}")
        if not self.fits_nvme:
            have = f"{gb(hw.nvme_free)} free at {hw.nvme_path}" if hw.nvme_path else "none (pass --nvme-path)"
            out.append(f"NVMe needs {gb(self.nvme_bytes)} per node of {have}")
        return out


def gb(n: int) -> str:
    """Bytes as decimal GB, the unit GPU and RAM sizes are sold in."""
    return f"{n / GB:,.1f} GB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M" if n >= 1e5 else str(n)


def element_bytes(precision: str) -> int:
    """Bytes per parameter, gradient or activation element: 2 for bf16/fp16 ("auto" planned as bf16), 4 for fp32."""
    return 4 if precision == "fp32" else 2


def describe(spec: ZeroSpec) -> str:
    """A short human name of a spec's memory-relevant choices."""
    text = f"ZeRO-{spec.stage}"
    opt, prm = spec.offload_optimizer.device, spec.offload_param.device
    if opt == "cpu" and spec.offload_optimizer.ratio < 1:
        opt = f"cpu, ratio {spec.offload_optimizer.ratio:g}"
    if opt != "none" and not spec.offload_optimizer.pin_memory:
        opt += ", not pinned"
    if opt != "none" and prm != "none":
        text += f" + offload optimizer ({opt}) and params ({prm})"
    elif opt != "none":
        text += f" + offload optimizer ({opt})"
    elif prm != "none":
        text += f" + offload params ({prm})"
    if spec.activation_checkpointing:
        text += " + checkpointing" + (f" (first {spec.checkpointed_layers} layers)" if spec.checkpointed_layers else "")
    if spec.activation_offload:
        text += " + activation offload"
    if spec.stage == 3 and not spec.gather_16bit_weights_on_save:
        text += " + saves ZeRO shards"
    return text


def _resolve(value: Any, auto: int) -> int:
    return auto if value == "auto" else int(value)


def layer_activation_bytes(shape: ModelShape, precision: str, seq_len: int, attention: str, liger: bool = False) -> int:
    """Bytes one decoder layer keeps for backward, per token (HF Llama code, no recomputation).

    Two RMSNorms (fp32 input copy 4h, normalized 16-bit, output 16-bit), q/k/v after RoPE and the attention
    output (16-bit), the kernel's fp32 log-sum-exp per head, and the SwiGLU MLP's gate, act, up, product.
    Eager attention repeats k/v to all heads and keeps the fp32 softmax and its 16-bit copy (seq per head).
    With Liger: each RMSNorm keeps its 16-bit input and an fp32 rstd (its 16-bit output is still kept by the
    projections after it); SwiGLU keeps gate, up and the product (the activation is recomputed).
    """
    b, h = element_bytes(precision), shape.hidden
    norms = 2 * (2 * b * h + 4) if liger else 2 * (4 * h + 2 * b * h)
    mlp = (3 if liger else 4) * b * shape.ffn
    if attention == "eager":
        attn = b * 4 * shape.q_dim + shape.heads * seq_len * (4 + (b if b != 4 else 0))
    else:
        attn = b * (2 * shape.q_dim + 2 * shape.kv_dim) + 4 * shape.heads
    return norms + attn + mlp


def pinned_block_bytes(nbytes: int) -> int:
    """Pinned host bytes that one tensor of `nbytes` takes: torch's pinned-memory cache (CachingHostAllocator)
    rounds every allocation up to a power of two (measured: 33 saved tensors of 192 MiB took 8.25 GiB pinned,
    benchmarks study activation-offload)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def _offload_activations(terms: list[Term], tokens: int, per_token: int, grad_accum: int, gpus: int,
                         pinned: int | None = None, pinned_text: str = "") -> str:
    """Activation offload's host term (pinned, per node) and its PCIe time, as a note. `pinned`: the pinned
    host bytes per GPU when they differ from the bytes moved (blocks rounded up to powers of two)."""
    moved = tokens * per_token
    terms.append(Term("activations offloaded (pinned)", "host", (moved if pinned is None else pinned) * gpus,
                      f"({pinned_text or f'{tokens} tokens x {per_token} B'}) x {gpus} GPUs/node", "activation"))
    ms = 1000 * moved / PCIE_BYTES_PER_S
    return (f"activation offload moves {gb(moved)} per GPU per micro batch each way over PCIe: {ms:,.0f} ms out in "
            f"forward and {ms:,.0f} ms back in backward at {PCIE_BYTES_PER_S / GB:.0f} GB/s (x {grad_accum} micro "
            "batches per step), overlapped with compute on side streams")


def gpu_kept_optimizer_elements(spec: ZeroSpec, state_n: int) -> tuple[int, int, int]:
    """Partial offload (`offload_optimizer.ratio` < 1): elements per rank whose fp32 states stay on the GPU, the
    rank's sub-groups, and how many of them stay. DeepSpeed 0.19 keeps sub-group i on the GPU when
    i < int((1 - ratio) x sub-groups), so the split moves in whole sub-groups: one sub-group keeps nothing."""
    opt = spec.offload_optimizer
    if spec.stage != 3 or opt.device != "cpu" or opt.ratio >= 1:
        return 0, 1, 0
    sizes = sub_groups(spec, state_n)
    kept_groups = int((1 - opt.ratio) * len(sizes))
    return sum(sizes[:kept_groups]), len(sizes), kept_groups


def sub_groups(spec: ZeroSpec, state_n: int) -> list[int]:
    """Elements of each optimizer sub-group of a rank: DeepSpeed closes a sub-group at the first parameter that takes
    it to >= sub_group_size, so groups overshoot a little and a small remainder rides along (the 8b probe: 4.015B
    elements per rank made 4 groups, measured through their pinned blocks); a remainder of 5% or more is a group."""
    full, rest = divmod(state_n, spec.sub_group_size)
    if full == 0:
        return [state_n]
    if rest < 0.05 * spec.sub_group_size:
        return [state_n // full] * (full - 1) + [state_n - (state_n // full) * (full - 1)]
    return [spec.sub_group_size] * full + [rest]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pinned_blocks(spec: ZeroSpec, grad_bytes: int, state_n: int, kept: int) -> list[int]:
    """Bytes of each pinned host block ZeRO-3 with optimizer offload allocates per rank (DeepSpeed 0.19 stage3.py):
    the flat 16-bit gradient partition; with device "cpu" one fp32 gradient buffer per CPU sub-group, and one more
    block of a sub-group's size if some sub-groups stay on the GPU (their pinned staging copy, freed into torch's
    cache and kept there). With "nvme" only the gradient partition: the optimizer's swap buffers are page-locked by
    DeepSpeed's aio handle (`new_cpu_locked_tensor`: posix_memalign + mlock, swap_tensor/utils.py), not by torch's
    caching host allocator, so they are not rounded (measured, 70B width on 2 x H200: torch's pinned peak 4.0 GiB per
    rank = the 2.2 GB gradient partition rounded; benchmarks study nvme-offload-70b-width)."""
    if spec.offload_optimizer.device == "nvme":
        return [grad_bytes]
    sizes = sub_groups(spec, state_n)
    kept_groups = len([None for total in itertools.accumulate(sizes) if total <= kept]) if kept else 0
    return [grad_bytes] + [4 * n for n in sizes[kept_groups:]] + ([4 * max(sizes)] if kept else [])


def plan(shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec) -> Plan:
    """Memory needed by one configuration: per GPU, per node of host RAM, per node of NVMe."""
    b, P, H = element_bytes(spec.precision), shape.params, shape.hidden
    W, g = hardware.world_size, hardware.gpus_per_node
    stage, opt = spec.stage, spec.offload_optimizer.device
    prm = spec.offload_param.device if stage == 3 else "none"
    part = math.ceil(P / W)
    param_n, grad_n, state_n = (part if stage == 3 else P), (part if stage >= 2 else P), (part if stage >= 1 else P)
    shard = lambda n: f"{_count(P)} / {W} GPUs" if n == part else f"{_count(P)} (whole model on every GPU)"
    terms: list[Term] = []
    notes: list[str] = []

    def add(where: str, name: str, per_rank: float, formula: str, kind: str = "state", allocator: bool = True,
            phase: str = "always"):
        if where in ("host", "nvme"):
            per_rank, formula, phase = per_rank * g, f"({formula}) x {g} GPUs/node", "always"
        terms.append(Term(name, where, int(per_rank), formula, kind, allocator, phase))

    place = {"none": "gpu", "cpu": "host", "nvme": "nvme"}
    # Model states (DeepSpeed 0.19: 16-bit params and gradients, fp32 master weights, Adam m and v, fp32 grads).
    add(place[prm], f"parameters, {8 * b}-bit", b * param_n, f"{b} B x {shard(param_n)}")
    if stage == 3 or opt == "none":  # stage 1/2 offload accumulates grads straight into fp32 host buffers
        add("host" if opt != "none" else "gpu", f"gradients, {8 * b}-bit", b * grad_n, f"{b} B x {shard(grad_n)}")
    kept, groups, kept_groups = gpu_kept_optimizer_elements(spec, state_n)
    if kept:  # partial offload: the first sub-groups keep their fp32 states and gradients on the GPU
        share = (f"{kept_groups} of {groups} sub-groups of {shard(state_n)} (ratio {spec.offload_optimizer.ratio:g}: "
                 f"int((1 - ratio) x {groups}) stay)")
        add("gpu", "fp32 master weights + Adam m, v (partial offload)", 12 * kept, f"(4 + 8) B x {share}")
        add("gpu", "fp32 gradients (partial offload)", 4 * kept, f"4 B x {share}: held from the first step")
        step_tmp = min(spec.sub_group_size, kept)
        add("gpu", "torch AdamW temporaries (GPU sub-groups)", 4 * step_tmp,
            f"4 B x one sub-group {_count(step_tmp)} (foreach AdamW's sqrt(v) copy; estimate)", "buffer",
            phase="step")
    rest = f" less the {_count(kept)} on the GPU" if kept else ""
    add(place[opt], "fp32 master weights + Adam m, v", 12 * (state_n - kept), f"(4 + 8) B x {shard(state_n)}{rest}")
    sub_group = min(spec.sub_group_size, state_n) if stage == 3 and opt == "none" else state_n - kept
    add(place[opt], "fp32 gradients" + (" (one sub-group)" if sub_group < state_n and not kept else ""),
        4 * sub_group, f"4 B x {shard(state_n)}{rest}" if sub_group == state_n - kept
        else f"4 B x sub_group_size {_count(sub_group)}", phase="step")
    if stage == 3 and opt == "none":  # stage3 _prepare_fp32_grad_for_sub_group: flatten(16-bit grads).to(fp32)
        add("gpu", f"gradients, {8 * b}-bit, one sub-group flattened for the step", b * sub_group,
            f"{b} B x {_count(sub_group)}", "buffer", phase="step")
    if stage < 3 and opt == "none":  # stage_1_and_2.step: flatten the 16-bit partition, then cast that to fp32
        add("gpu", f"gradients, {8 * b}-bit, flattened for the step", b * state_n, f"{b} B x {shard(state_n)}",
            "buffer", phase="step")
    if stage == 2 and opt == "none" and W > 1:
        add("gpu", f"gradients, {8 * b}-bit, second partition (last rank)", b * grad_n,
            f"{b} B x {shard(grad_n)}: measured, DeepSpeed 0.19.8", "buffer",
            phase="backward")
    if opt == "nvme":
        swap = spec.offload_optimizer.buffer_count * 4 * min(spec.sub_group_size, state_n)
        add("host", "optimizer NVMe swap buffers (pinned)", swap,
            f"{spec.offload_optimizer.buffer_count} buffers x 4 B x min(sub_group_size, P/W), page-locked by aio "
            "(not rounded)", "buffer")
    if stage == 3 and opt != "none" and spec.offload_optimizer.pin_memory:
        blocks = pinned_blocks(spec, b * grad_n, state_n, kept)
        add("host", "pinned buffers rounded up to powers of 2", sum(_pow2(x) - x for x in blocks),
            f"torch's caching host allocator rounds each pinned block up to a power of 2: {len(blocks)} block(s), "
            f"largest {gb(max(blocks))} -> {gb(_pow2(max(blocks)))} (measured: 24.0 GiB pinned per rank for 22.4)",
            "buffer")
    if prm == "cpu":
        add("host", f"parameters, {8 * b}-bit, defragmentation copy", b * param_n,
            f"{b} B x {shard(param_n)}: made once at start; the pinned cache keeps it (measured)", "buffer")
    if prm == "nvme":
        count, size = spec.offload_param.buffer_count, spec.offload_param.buffer_size
        add("host", "param NVMe swap buffers (pinned)", count * size * b, f"{count} x {_count(size)} x {b} B",
            "buffer")
    # Buffers: ZeRO-3 gathers parameters module by module; gradients are reduced through a bucket.
    if gathers_are_views(spec, hardware):
        notes.append("one GPU: ZeRO-3's gathers are views of the parameters' partition, no gather buffers"
                     + (" (every parameter persists: no per-module fetch)"
                        if persists_every_parameter(spec, shape) else ""))
    elif stage == 3:
        threshold = _resolve(spec.param_persistence_threshold, 10 * H)
        small = shape.persistent_params(min(threshold, 10 * H))
        large = shape.persistent_params(threshold) - small
        if small:
            add("gpu", "persistent small params + grads (norms)", 2 * b * small,
                f"2 x {b} B x {_count(small)}: the tensors of at most {_count(min(threshold, 10 * H))} elements "
                "(norms, biases)", "buffer")
        if large:
            add("gpu", "persistent weights, whole on every GPU", b * large,
                f"{b} B x {_count(large)}: the weight tensors of at most {_count(threshold)} elements "
                "(stage3_param_persistence_threshold) stay gathered beside their partitions", "buffer")
        prefetch = _resolve(spec.prefetch_bucket_size, int(0.9 * H * H))
        live = min(P, max(spec.max_live_parameters, shape.largest_module_params + prefetch))
        add("gpu", "gathered params (live)", b * live,
            f"{b} B x {_count(live)}: max_live_parameters, or largest module {_count(shape.largest_module_params)}"
            f" + prefetch {_count(prefetch)} if larger, at most P", "buffer", phase="backward")
    if stage == 3:  # on one GPU too: a module's gradient is whole before it goes to the partition
        add("gpu", "gathered grads (largest module)", b * shape.largest_module_params,
            f"{b} B x {_count(shape.largest_module_params)}", "buffer", phase="backward")
    reduce_bucket = _resolve(spec.reduce_bucket_size, H * H)
    add("gpu", "reduce bucket", b * reduce_bucket, f"{b} B x {_count(reduce_bucket)}", "buffer")
    # Activations of one micro batch.
    t, L = training.tokens, shape.layers
    per_layer = layer_activation_bytes(shape, spec.precision, training.seq_len, training.attention, training.liger)
    final_norm = b * H + 4 if training.liger else 4 * H + 2 * b * H
    if spec.activation_checkpointing and spec.activation_offload:
        n = min(L, OFFLOAD_IN_FLIGHT_LAYERS)
        add("gpu", "activations: checkpointed layer inputs in flight (rest offloaded)", t * n * b * H,
            f"{t} tokens x {n} layers x {b} B x {H}", "activation", phase="backward")
        work, work_text = 2 * per_layer, f"recomputed layer + its gradients: 2 x {per_layer} B"
    elif spec.activation_checkpointing:
        n = L if spec.checkpointed_layers is None else min(L, spec.checkpointed_layers)
        add("gpu", "activations: checkpointed layer inputs", t * (n * b * H + final_norm),
            f"{t} tokens x ({n} layers x {b} B x {H} + final norm {final_norm} B)", "activation", phase="backward")
        if n < L:  # gradient_checkpointing_layers: the last L - n layers keep everything
            add("gpu", f"activations: {L - n} layers stored (not checkpointed)", t * (L - n) * per_layer,
                f"{t} tokens x {L - n} x {per_layer} B/layer ({training.attention})", "activation", phase="backward")
        work, work_text = 2 * per_layer, f"recomputed layer + its gradients: 2 x {per_layer} B"
    elif spec.activation_offload:
        add("gpu", "activations: one layer in flight (rest offloaded)", t * per_layer,
            f"{t} tokens x {per_layer} B/layer ({training.attention})", "activation", phase="backward")
        work, work_text = per_layer, f"one layer's gradients: {per_layer} B"
    else:
        add("gpu", f"activations: {L} layers stored", t * (L * per_layer + final_norm),
            f"{t} tokens x ({L} x {per_layer} B/layer ({training.attention}) + final norm {final_norm} B)",
            "activation", phase="backward")
        work, work_text = per_layer, f"one layer's gradients: {per_layer} B"
    if spec.activation_offload:
        pinned, pinned_text = None, ""
        if spec.activation_checkpointing:  # L + 1 tensors of t x b x H (layer inputs, final norm input) + the rest
            block, rest = pinned_block_bytes(t * b * H), pinned_block_bytes(t * (final_norm - b * H))
            pinned = (L + 1) * block + rest
            pinned_text = (f"{L + 1} x {t * b * H} B layer inputs in {block} B pinned blocks + final norm's "
                           f"{t * (final_norm - b * H)} B in {rest} B: powers of two")
        notes.append(_offload_activations(terms, t, L * (b * H if spec.activation_checkpointing else per_layer)
                                          + final_norm, training.grad_accum, g, pinned, pinned_text))
    if training.liger:  # liger_kernel.ops.fused_linear_cross_entropy: logits chunk by chunk, gradients in forward
        chunk = min(t, 1 << max(0, math.ceil(t / math.ceil(shape.vocab / H)) - 1).bit_length())
        add("gpu", "fused linear cross-entropy (Liger)", b * t * H + 4 * t + b * shape.vocab * H + b * chunk * shape.vocab,
            f"{b} B x {t} tokens x {H} (input grad) + fp32 loss per token + {b} B x vocab {shape.vocab} x {H} "
            f"(lm_head grad) + a {chunk}-token chunk of {b}-byte logits", "activation", phase="backward")
        logits = 0
    else:
        logits = LOGITS_BYTES_PER_VOCAB * shape.vocab
        add("gpu", "logits + loss (fp32 cross-entropy)", t * logits, f"{t} tokens x 12 B x vocab {shape.vocab}",
            "activation", phase="backward")
    add("gpu", "backward working set beyond the logits peak", t * max(0, work - logits),
        f"{t} tokens x max(0, {work_text} - {logits} B)", "activation", phase="backward")
    allocated = Plan(shape, hardware, training, spec, tuple(terms)).gpu_allocated_bytes
    fixed = hardware.fixed
    margin, tight = dict(fixed.gpu_margin)[stage], dict(fixed.gpu_margin_near_full).get(stage)
    left = hardware.usable(hardware.gpu_mem) - fixed.cuda_context - allocated
    if tight is not None and tight * allocated <= left < margin * allocated:
        add("gpu", "allocator fragmentation margin", left, f"what the GPU leaves: {left / allocated:.1%} of allocated "
            f"(near full: at least {tight:.0%}, measured; {margin:.0%} with room)", "overhead", False)
        notes.append(f"tight fit: {left / allocated:.1%} of allocated left for fragmentation (measured need near a "
                     f"full GPU: {tight:.0%}); the allocator will release cached blocks, which can cost some speed")
    else:
        add("gpu", "allocator fragmentation margin", margin * allocated, f"{margin:.0%} of allocated at the peak",
            "overhead", False)
    add("gpu", "CUDA context + NCCL buffers", fixed.cuda_context, f"NVML used - torch reserved: {fixed.source}",
        "overhead", False)
    # Host RAM per node beyond offloaded states.
    add("host", "training processes", fixed.host_per_rank, f"{gb(fixed.host_per_rank)} per rank", "overhead")
    if stage == 3 and spec.gather_16bit_weights_on_save:
        terms.append(Term("16-bit model gathered on rank 0 to save", "host", b * P,
                          f"{b} B x {_count(P)} at every save (checkpoints, the final model): "
                          "stage3_gather_16bit_weights_on_model_save; on the first node only (measured, 10.7B on "
                          "1 x H200: +20.2 GiB for 20.0)", "buffer"))
    loading, load_b = (shape.largest_module_params if stage == 3 else P), training.load_bytes or b
    add("host", "loading weights", load_b * loading, f"{load_b} B x {_count(loading)}"
        + (" (ZeRO-3 loads one tensor at a time)" if stage == 3 else " (each rank loads the whole model)"), "buffer")
    host = sum(x.bytes for x in terms if x.where == "host")
    terms.append(Term("host margin", "host", int(HOST_MARGIN * host), f"{HOST_MARGIN:.0%} of the above", "overhead"))
    if stage == 3 and prm == "none":  # before the first step, while no offloaded state exists yet
        terms.append(Term("start-up: ranks at rest", "host", g * STARTUP_RANK_BYTES,
                          f"{gb(STARTUP_RANK_BYTES)} x {g} GPUs/node (measured: the 7b's rank beside its copy below)",
                          "overhead", phase="startup"))
        terms.append(Term("start-up: 16-bit partitions packed through host memory", "host", g * b * part,
                          f"{b} B x {shard(part)} x {g} GPUs/node: DeepSpeed's ZeRO-3 optimizer builds each rank's "
                          "flat 16-bit buffer through a host tensor (`defragment`, runtime/zero/utils.py); measured "
                          "on 1 x H200: 13.74 GiB held by the 7b's rank for 12.55 GiB of partitions", "buffer",
                          phase="startup"))
    if spec.precision == "auto":
        notes.append('precision "auto" is planned as bf16')
    if training.seq_len > shape.max_positions:
        notes.append(f"seq_len {training.seq_len} exceeds the model's max positions ({shape.max_positions})")
    return Plan(shape, hardware, training, spec, tuple(terms), tuple(notes))


# --- choosing -------------------------------------------------------------------------------------

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


def persists_every_parameter(spec: ZeroSpec, shape: ModelShape) -> bool:
    """Whether ZeRO-3's persistence threshold keeps every tensor of this model whole (EVERY_PARAMETER, or any value
    at least its largest tensor)."""
    threshold = _resolve(spec.param_persistence_threshold, 10 * shape.hidden)
    return spec.stage == 3 and shape.persistent_params(threshold) == shape.params


def gathers_are_views(spec: ZeroSpec, hardware: Hardware) -> bool:
    """ZeRO-3 on one rank with the parameters on the GPU: a "gather" makes the parameter a view of its partition
    (DeepSpeed 0.19 `_no_gather_coalesced`), so gathered and persistent parameters take no memory of their own."""
    return spec.stage == 3 and hardware.world_size == 1 and spec.offload_param.device == "none"


def _offload_level(spec: ZeroSpec) -> tuple[float, float]:
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
    return (_offload_level(p.spec), p.spec.activation_checkpointing, p.spec.activation_offload,
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
    per_rank, rest = divmod(global_batch, hardware.world_size)
    if rest or per_rank < 1:
        raise PlanError(f"global batch {global_batch} is not a multiple of {hardware.world_size} GPUs: use a "
                        f"multiple such as {max(1, round(global_batch / hardware.world_size)) * hardware.world_size}")
    if micro_batch is not None:
        if per_rank % micro_batch:
            raise PlanError(f"micro batch {micro_batch} does not divide the {per_rank} samples per GPU of global "
                            f"batch {global_batch}: use a divisor of {per_rank}")
        return [(micro_batch, per_rank // micro_batch)]
    return [(m, per_rank // m) for m in range(per_rank, 0, -1) if per_rank % m == 0]


def candidates(shape: ModelShape, hardware: Hardware, seq_len: int, *, global_batch: int | None = None,
               micro_batch: int | None = None, precision: str = "bf16", attention: Attention = "sdpa",
               load_bytes: int | None = None, liger: bool = False) -> list[Plan]:
    """Every configuration the planner considers, cheapest first."""
    plans, kept_seen = [], set()
    for rung in _rungs(hardware, precision, shape.params):
        if rung.offload_optimizer.ratio < 1:  # a ratio that keeps no more sub-groups than a smaller one adds nothing
            kept = gpu_kept_optimizer_elements(rung, math.ceil(shape.params / hardware.world_size))[0]
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
                                   "global_batch_size": micro * accum * hardware.world_size})
                training = Training(seq_len, micro, accum, attention, load_bytes, liger)
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
           load_bytes: int | None = None, liger: bool = False, speed_table: tuple | None = None) -> Choice:
    """The fastest fitting configuration, with its ds_config and TrainingArguments overrides: the least offload, no
    checkpointing unless needed or measured faster (`plan.speed.faster_measured`), each stage at its largest fitting
    micro batch, and between ZeRO-2 and ZeRO-3 the one measured faster (`plan.speed.fastest`). A plan that fits only
    tightly (`Plan.tight`) is chosen only when no plan fits with the full margin.

    `load_bytes`: see `Training.load_bytes` (4 when the model is built from a config); `liger`: `Training.liger`;
    `speed_table`: measurements to decide by (default `plan.speed.MEASURED`)."""
    kwargs = {"global_batch": global_batch, "micro_batch": micro_batch, "precision": precision,
              "attention": attention, "load_bytes": load_bytes, "liger": liger}
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


# --- after an OOM ---------------------------------------------------------------------------------

def oom_advice(shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec, *,
               host: bool = False, ds_config_path: str | None = None) -> str:
    """The planner's next step after a CUDA OOM (or a host OOM with `host=True`), as exact overrides.

    The run just proved the prediction too low, so only steps that give up memory on every axis are
    considered (same or higher stage and offload, checkpointing kept, micro batch not larger, samples
    per GPU per step unchanged); of those that need less of the exhausted memory and are predicted to
    fit, the cheapest in `cost_key` order is the answer.
    """
    current = plan(shape, hardware, training, spec)
    what = "host RAM" if host else "GPU memory"
    need = (lambda p: p.host_bytes) if host else (lambda p: p.gpu_bytes)
    per_rank = training.micro_batch * training.grad_accum
    options = [p for p in candidates(shape, hardware, training.seq_len, global_batch=per_rank * hardware.world_size,
                                     precision=spec.precision, attention=training.attention, liger=training.liger)
               if _at_least_as_frugal(p, current, host) and need(p) < need(current)]
    nxt = next((p for p in options if p.fits), None)
    head = (f"hf_zero3: out of {what}. Planned for this run: {gb(need(current))} ({current.label}, "
            f"micro batch {training.micro_batch}).")
    if nxt is None:
        choice = choose(shape, hardware, training.seq_len, precision=spec.precision, attention=training.attention,
                        liger=training.liger)
        return f"{head} No more frugal option is predicted to fit. {choice.advice}".strip()
    return (f"{head} Next step (predicted {gb(need(nxt))}: {nxt.label}, micro batch {nxt.training.micro_batch}): "
            f"{_how(current, nxt, ds_config_path)}")


def _at_least_as_frugal(p: Plan, current: Plan, host: bool = False) -> bool:
    """Gives up memory on every axis; after a host OOM a smaller partial-offload ratio also counts (it moves
    optimizer states from the host to the GPU, and the plan must still fit the GPU)."""
    a, b = p.spec, current.spec
    less_on_host = host and a.offload_optimizer.device == b.offload_optimizer.device == "cpu" and (
        a.offload_param.device == b.offload_param.device)
    return (a.stage >= b.stage and (_offload_level(a) >= _offload_level(b) or less_on_host)
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
