"""The planner's types: the machines (`Hardware` and its measured `FixedTerms`), what one step processes
(`Training`), and a configuration's memory term by term (`Plan`).

Why apart from the arithmetic (`plan.memory`): the speed table (`plan.speed`), the hardware detection, the named
machines and the report read these types without needing the memory model, and the chooser asks the speed table;
with the types in `memory.py` (which held the chooser too) the two modules needed each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.units import GB, gb

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
GPU_MARGIN_LORA = {2: 0.02, 3: 0.02}
"""The fragmentation of a LoRA run (a frozen base, a small adapter), by ZeRO stage, in place of `GPU_MARGIN`: its step
makes and frees only adapter-sized copies. Measured on 1 x H200, Llama-3-8B shape, micro 4 x 4096 at ZeRO-2: reserved
120.1 GiB for 119.6 allocated, 0.4% (benchmarks study lora-8b-h200); micro 2 x 4096 at ZeRO-3 (then with DeepSpeed's
linear and an fp32 adapter): 99.7 GiB for 99.0, 0.7% (study lora-8b-h200-rerun). Planned at 2% until more runs
measure it."""
HOST_PER_RANK_BYTES = int(6.5 * GB)
"""Resident memory of one training process beyond what it holds for the model: Python, torch, CUDA, NCCL and
DeepSpeed. Measured with offload on 2 x H200: 5.7-6.1 GiB per rank (benchmarks study memory-probe-8b)."""

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
    gpu_margin_lora: tuple[tuple[int, float], ...] = tuple(GPU_MARGIN_LORA.items())
    """Fragmentation of a LoRA run by ZeRO stage, where measured (else `gpu_margin`)."""
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
class Adapter:
    """A LoRA adapter on a frozen base, as the planner counts it: what trains, and what its layers keep for backward."""

    params: int
    """Its parameters (`plan.lora.adapter_params`, or a built model's count): the only ones that train."""
    rank: int
    """r: each adapted layer's A is r x in, its B out x r."""
    targets: tuple[str, ...]
    """The adapted linear layers of each decoder layer, by name (`plan.lora.linear_layers`: q_proj, ..., down_proj)."""
    dropout: bool = True
    """Dropout on the adapter's input (peft's `lora_dropout` > 0): each adapted layer then keeps its own dropped-out
    copy of its input and the mask, instead of sharing the input with the frozen layer."""

    def __post_init__(self):
        if self.params < 1 or self.rank < 1:
            raise PlanError(f"a LoRA adapter needs params >= 1 and rank >= 1 (got {self.params}, {self.rank})")
        if not self.targets:
            raise PlanError("a LoRA adapter needs at least one target layer")


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
    adapter: Adapter | None = None
    """LoRA: the adapter (`plan.lora.adapter`), whose parameters are the only ones that train; they come on top of the
    frozen base, which keeps its 16-bit partitions and nothing else (no gradients, fp32 master or optimizer states).
    Its layers change what the activations keep (`plan.memory.lora_layer_activation_bytes`). None: every parameter
    trains."""

    preference: Preference | None = None
    """A preference stage (DPO, ORPO, KTO, ...; `plan.preference`): the sequences each example puts through one forward
    and the reference model it keeps. None: SFT."""
    trainer: Literal["trl", "transformers"] = "trl"
    """Whose loss: "trl", the stage's TRL trainer, as `hf-zero3 train` runs it (SFT, DPO, KTO: TRL's fused LM head,
    the logits in tiles; ORPO, SimPO: the whole logits, or Liger's); "transformers", the stock Trainer (the whole
    logits, or Liger's fused linear cross-entropy): what the runs of the planner's measurements ran (`plan.lm_head`)."""

    @property
    def trainable(self) -> int | None:
        """The parameters that train when they are not all of them (a LoRA adapter's); None: every parameter."""
        return self.adapter.params if self.adapter is not None else None

    def __post_init__(self):
        for name in ("seq_len", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.load_bytes not in (None, 2, 4):
            raise PlanError(f"load_bytes must be 2 or 4 (got {self.load_bytes})")
        if self.attention not in ATTENTIONS:
            raise PlanError(f"attention must be sdpa, flash_attention_2 or eager (got {self.attention!r})")
        if self.trainer not in ("trl", "transformers"):
            raise PlanError(f"trainer must be trl or transformers (got {self.trainer!r})")

    @property
    def tokens(self) -> int:
        """Tokens in one micro batch: what the activations scale with (a pair's chosen and rejected: two sequences)."""
        return self.micro_batch * self.seq_len * (self.preference.sequences if self.preference else 1)


@dataclass(frozen=True)
class Preference:
    """What a preference stage adds to a step: `sequences` per example in one forward (2 for a pair, chosen and
    rejected concatenated), and the reference model: "engine" (a second model, partitioned like the policy, forward
    only) or "none" (LoRA's adapter disabled, precomputed log-probs, or a reference-free loss)."""

    stage: str
    sequences: int = 2
    reference: Literal["engine", "none"] = "engine"


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
