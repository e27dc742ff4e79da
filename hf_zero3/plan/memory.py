"""The memory model: what one ZeRO configuration needs per GPU, per node (host RAM) and on NVMe, term by term.

`plan()` is pure arithmetic over dataclasses (no CUDA calls), so a GPU run can compare
`plan(...).gpu_allocated_bytes` with `torch.cuda.max_memory_allocated()`. Which configuration to run is
`plan.choose`'s; the next step after an OOM is `plan.advice`'s. Every term, its formula and where it differs from
DeepSpeed's estimator: docs/planner.md.
"""

from __future__ import annotations

import math
from typing import Any

from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan import lm_head, preference
from hf_zero3.plan.lora import linear_layers
from hf_zero3.plan.partitions import (
    gpu_kept_optimizer_elements,
    pinned_blocks,
    rank_partitions,
    round_up_to_power_of_2,
    sub_groups,
)
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.types import Hardware, Plan, Term, Training
from hf_zero3.units import GB, gb

HOST_MARGIN = 0.05
"""Headroom on the host total (allocator, OS); the terms themselves are measured, so it is small."""
STARTUP_RANK_BYTES = 1_280_000_000
"""A rank's host memory at rest before its first step (CUDA, torch, DeepSpeed loaded): 13.74 GiB at the 7b's start-up
peak less its 12.55 GiB of 16-bit partitions (benchmarks study recipes-proof-7b-1gpu)."""
LOGITS_BYTES_PER_VOCAB = 12
"""Per token and vocabulary entry at cross-entropy's backward: fp32 log-softmax output kept for backward,
its incoming gradient and the fp32 gradient of the logits (transformers upcasts logits to fp32)."""

OFFLOAD_IN_FLIGHT_LAYERS = 4
"""Activation offload (hf_zero3.model.activation_offload): checkpointed layer inputs on the GPU at once in backward,
the one in use, the two prefetched (its PREFETCH_FACTOR) and about one more not yet released: ~4 at the peak by the
per-token slopes on 2 x H200 (benchmarks study activation-offload); without checkpointing, about one layer's tensors."""
LIGER_BACKWARD_HIDDEN_GRADIENTS = 2
"""With Liger (its SwiGLU backward writes the gradients into the tensors it saved), a recomputed dense layer's
backward holds its saved tensors and about two hidden-wide gradients more, not a second copy of the layer: 101.5
KB/token measured for the 3B shape (90.2 saved + 11.3) at 131,072 and 294,912 tokens, with and without activation
offload (benchmarks studies long-seq-3b-h100 and long-seq-3b-h100-vs-stock); the checkpointed 7B runs on one H200
plan 0.6-3.5% above what they measured with it. Without Liger, or with experts, the layer's gradients are planned
whole (no long-sequence measurement)."""
PCIE_BYTES_PER_S = 25 * GB
"""Pinned host<->GPU copy rate per GPU assumed for the PCIe time of activation offload (PCIe 4.0 x16 measures
~25 GB/s, 5.0 ~50): the copies overlap compute on side streams, so this is what the step must be longer than."""

MOE_LOAD_COPIES = 2
"""Loading a per-expert checkpoint into fused experts under ZeRO-3 holds a block twice, as read and as fused, before
it is partitioned: measured 1.82-1.96 x one block per rank, the same at 4, 8 and 16 layers (benchmarks study
moe-load-rss)."""


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M" if n >= 1e5 else str(n)


def element_bytes(precision: str) -> int:
    """Bytes per parameter, gradient or activation element: 2 for bf16/fp16 ("auto" planned as bf16), 4 for fp32."""
    return 4 if precision == "fp32" else 2


def _resolve(value: Any, auto: int) -> int:
    return auto if value == "auto" else int(value)


def layer_activation_bytes(shape: ModelShape, precision: str, seq_len: int, attention: str, liger: bool = False) -> int:
    """Bytes one decoder layer keeps for backward, per token (HF Llama code, no recomputation).

    Two RMSNorms (fp32 input copy 4h, normalized 16-bit, output 16-bit), q/k/v after RoPE and the attention
    output (16-bit), the kernel's fp32 log-sum-exp per head, and the SwiGLU MLP's gate, act, up, product.
    Eager attention repeats k/v to all heads and keeps the fp32 softmax and its 16-bit copy (seq per head).
    With Liger: each RMSNorm keeps its 16-bit input and an fp32 rstd (its 16-bit output is still kept by the
    projections after it); SwiGLU keeps gate, up and the product (the activation is recomputed). A mixture of
    experts' MLP spans the routed experts' widths (`active_ffn`), plus the router's fp32 logits and probabilities
    and the token's copy into and out of each expert it is routed to.
    """
    b, h = element_bytes(precision), shape.hidden
    norms = 2 * (2 * b * h + 4) if liger else 2 * (4 * h + 2 * b * h)
    mlp = (3 if liger else 4) * b * shape.active_ffn
    if shape.experts:  # router logits and their softmax (fp32), each routed copy of the token in and out
        mlp += 8 * shape.experts + 2 * b * shape.experts_per_token * h
    if attention == "eager":
        attn = b * 4 * shape.q_dim + shape.heads * seq_len * (4 + (b if b != 4 else 0))
    else:
        attn = b * (2 * shape.q_dim + 2 * shape.kv_dim) + 4 * shape.heads
    return norms + attn + mlp


DROPOUT_MASK_BYTES = 1
"""Per element of a dropped-out tensor, kept for backward: CUDA's fused dropout (`native_dropout`) keeps a bool mask.
(The composite dropout of a CPU keeps its mask in the input's dtype: the CPU tests pass that instead.)"""


def lora_layer_activation_bytes(shape: ModelShape, spec: ZeroSpec, training: Training,
                                mask_bytes: int = DROPOUT_MASK_BYTES) -> int:
    """Bytes one decoder layer keeps for backward per token with a LoRA adapter on a frozen base (no recomputation):
    `layer_activation_bytes` less what only the frozen weights' gradients needed, plus what the adapter keeps.

    A frozen layer's input is kept only for its weight's gradient, so it is dropped, at every ZeRO stage: ZeRO-3's
    linear is `model.zero3_linear`, which keeps an input only for a weight that trains (DeepSpeed's own keeps every
    input). peft's adapted layer computes `B(A(dropout(x)))` beside the frozen one, in the training precision (the
    adapter is not upcast under DeepSpeed: `model.lora.apply`): with dropout, A keeps the dropped-out copy of x and
    dropout its mask, per adapted layer (q, k and v each keep their own copy of the one input); without dropout A
    keeps x itself (shared, nothing more). B keeps A's r outputs. So per token: the two norms' outputs (q, k, v's
    input; gate, up's input) and the SwiGLU product (down's input) go unless an adapter without dropout still keeps
    them; eager attention's output likewise (o_proj's input; sdpa and flash keep theirs). Without Liger, the frozen
    norm weights no longer keep their normalized 16-bit copies. Checked exactly against what torch saves for a tiny
    Llama with peft on CPU (tests/unit/test_planner_lora.py)."""
    adapter, b, h = training.adapter, element_bytes(spec.precision), shape.hidden
    full = layer_activation_bytes(shape, spec.precision, training.seq_len, training.attention, training.liger)
    if adapter is None:
        return full
    inputs = {name: width for name, (width, _) in linear_layers(shape).items()}

    def still_kept(layers: tuple[str, ...]) -> bool:  # A keeps the very tensor the frozen layer reads
        return not adapter.dropout and any(n in adapter.targets for n in layers)

    dropped = (0 if still_kept(("q_proj", "k_proj", "v_proj")) else b * h) \
        + (0 if still_kept(("gate_proj", "up_proj")) else b * h) \
        + (0 if still_kept(("down_proj",)) else b * shape.ffn) \
        + (0 if training.attention != "eager" or still_kept(("o_proj",)) else b * shape.q_dim) \
        + (0 if training.liger else 2 * b * h)
    own = b + mask_bytes if adapter.dropout else 0
    added = sum(own * inputs[n] + b * adapter.rank for n in adapter.targets)
    return full - dropped + added


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


class Breakdown:
    """One configuration's terms as `plan` adds them, group by group, and the sizes every group reads: `b` bytes per
    16-bit (or fp32) element, `P` the model's parameters, `T` those that train (a LoRA adapter's, on top of the
    frozen base), `W` ranks, `g` GPUs per node, and each state's elements per rank."""

    def __init__(self, shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec):
        self.shape, self.hardware, self.training, self.spec = shape, hardware, training, spec
        self.b, self.P, self.H = element_bytes(spec.precision), shape.params, shape.hidden
        self.W, self.g = hardware.world_size, hardware.gpus_per_node
        self.stage, self.opt = spec.stage, spec.offload_optimizer.device
        self.prm = spec.offload_param.device if self.stage == 3 else "none"
        self.lora = training.trainable is not None
        self.T = training.trainable if self.lora else self.P
        self.held = self.P + self.T if self.lora else self.P
        self.part, self.tpart = math.ceil(self.held / self.W), math.ceil(self.T / self.W)
        self.param_n = self.part if self.stage == 3 else self.held
        self.grad_n = self.tpart if self.stage >= 2 else self.T
        self.state_n = self.tpart if self.stage >= 1 else self.T
        self.terms: list[Term] = []
        self.notes: list[str] = []
        if self.lora:
            self.notes.append(f"LoRA: {_count(self.T)} adapter parameters train, the {_count(self.P)} of the base are "
                              "frozen (their 16-bit partitions only: no gradients, fp32 master or optimizer states)")

    def shard(self, n: int, of: int | None = None) -> str:
        """How `n` elements per rank come from `of` (default: the parameters every rank holds a share of)."""
        of = self.held if of is None else of
        return f"{_count(of)} / {self.W} GPUs" if n == math.ceil(of / self.W) else f"{_count(of)} (whole model on every GPU)"

    def add(self, where: str, name: str, per_rank: float, formula: str, kind: str = "state", allocator: bool = True,
            phase: str = "always") -> None:
        """A term given per rank: host and NVMe terms are counted per node (x GPUs per node)."""
        if where in ("host", "nvme"):
            per_rank, formula, phase = per_rank * self.g, f"({formula}) x {self.g} GPUs/node", "always"
        self.terms.append(Term(name, where, int(per_rank), formula, kind, allocator, phase))


PLACE = {"none": "gpu", "cpu": "host", "nvme": "nvme"}
"""Where an offload device puts what it holds."""


def plan(shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec) -> Plan:
    """Memory needed by one configuration: per GPU, per node of host RAM, per node of NVMe. Each group of terms is
    one function below, called in the order the breakdown lists them."""
    x = Breakdown(shape, hardware, training, spec)
    partitions = None if x.lora else rank_partitions(shape, x.W)  # the adapter's order is peft's
    kept = model_state_terms(x, partitions)
    offload_buffer_terms(x, partitions, kept)
    gather_terms(x)
    activation_terms(x)
    x.terms += preference.reference_terms(x.shape, x.hardware, x.training, x.spec, x.b)  # a preference stage's
    x.notes += preference.notes(x.training)  # second model
    gpu_overhead_terms(x)
    host_terms(x)
    if spec.precision == "auto":
        x.notes.append('precision "auto" is planned as bf16')
    if training.seq_len > shape.max_positions:
        x.notes.append(f"seq_len {training.seq_len} exceeds the model's max positions ({shape.max_positions})")
    return Plan(shape, hardware, training, spec, tuple(x.terms), tuple(x.notes))


def model_state_terms(x: Breakdown, partitions: list[int] | None) -> int:
    """DeepSpeed 0.19's model states: 16-bit parameters and gradients, fp32 master weights, Adam m and v, fp32
    gradients, and the step's flattened copies. Returns the optimizer elements kept on the GPU (partial offload)."""
    b, T, spec, stage, opt = x.b, x.T, x.spec, x.stage, x.opt
    x.add(PLACE[x.prm], f"parameters, {8 * b}-bit", b * x.param_n, f"{b} B x {x.shard(x.param_n)}")
    if stage == 3 or opt == "none":  # stage 1/2 offload accumulates grads straight into fp32 host buffers
        x.add("host" if opt != "none" else "gpu", f"gradients, {8 * b}-bit", b * x.grad_n,
              f"{b} B x {x.shard(x.grad_n, T)}")
    state_n = x.state_n
    kept, groups, kept_groups = gpu_kept_optimizer_elements(spec, state_n, partitions)
    sizes = sub_groups(spec, state_n, partitions)
    if kept:  # partial offload: the first sub-groups keep their fp32 states and gradients on the GPU
        share = (f"{kept_groups} of {groups} sub-groups of {x.shard(state_n, T)} (ratio "
                 f"{spec.offload_optimizer.ratio:g}: int((1 - ratio) x {groups}) stay)")
        x.add("gpu", "fp32 master weights + Adam m, v (partial offload)", 12 * kept, f"(4 + 8) B x {share}")
        x.add("gpu", "fp32 gradients (partial offload)", 4 * kept, f"4 B x {share}: held from the first step")
        step_tmp = max(sizes[:kept_groups])
        x.add("gpu", "torch AdamW temporaries (GPU sub-groups)", 4 * step_tmp,
              f"4 B x one sub-group {_count(step_tmp)} (foreach AdamW's sqrt(v) copy; estimate)", "buffer",
              phase="step")
    rest = f" less the {_count(kept)} on the GPU" if kept else ""
    x.add(PLACE[opt], "fp32 master weights + Adam m, v", 12 * (state_n - kept),
          f"(4 + 8) B x {x.shard(state_n, T)}{rest}")
    sub_group = max(sizes) if stage == 3 and opt == "none" else state_n - kept
    x.add(PLACE[opt], "fp32 gradients" + (" (one sub-group)" if sub_group < state_n and not kept else ""),
          4 * sub_group, f"4 B x {x.shard(state_n, T)}{rest}" if sub_group == state_n - kept
          else f"4 B x the largest sub-group, {_count(sub_group)}", phase="step")
    if stage == 3 and opt == "none":  # stage3 _prepare_fp32_grad_for_sub_group: flatten(16-bit grads).to(fp32)
        x.add("gpu", f"gradients, {8 * b}-bit, one sub-group flattened for the step", b * sub_group,
              f"{b} B x {_count(sub_group)}", "buffer", phase="step")
    if stage < 3 and opt == "none":  # stage_1_and_2.step: flatten the 16-bit partition, then cast that to fp32
        x.add("gpu", f"gradients, {8 * b}-bit, flattened for the step", b * state_n, f"{b} B x {x.shard(state_n, T)}",
              "buffer", phase="step")
    if stage == 2 and opt == "none" and x.W > 1:
        x.add("gpu", f"gradients, {8 * b}-bit, second partition (last rank)", b * x.grad_n,
              f"{b} B x {x.shard(x.grad_n, T)}: measured, DeepSpeed 0.19.8", "buffer", phase="backward")
    return kept


def offload_buffer_terms(x: Breakdown, partitions: list[int] | None, kept: int) -> None:
    """Offload's host buffers: NVMe swap buffers, the pinned blocks' rounding, the parameters' defragmentation copy."""
    b, spec, opt, prm = x.b, x.spec, x.opt, x.prm
    if opt == "nvme":
        swap = spec.offload_optimizer.buffer_count * 4 * min(spec.sub_group_size, x.state_n)
        x.add("host", "optimizer NVMe swap buffers (pinned)", swap,
              f"{spec.offload_optimizer.buffer_count} buffers x 4 B x min(sub_group_size, P/W), page-locked by aio "
              "(not rounded)", "buffer")
    if x.stage == 3 and opt != "none" and spec.offload_optimizer.pin_memory:
        blocks = pinned_blocks(spec, b * x.grad_n, x.state_n, kept, partitions)
        x.add("host", "pinned buffers rounded up to powers of 2", sum(round_up_to_power_of_2(n) - n for n in blocks),
              f"torch's caching host allocator rounds each pinned block up to a power of 2: {len(blocks)} block(s), "
              f"largest {gb(max(blocks))} -> {gb(round_up_to_power_of_2(max(blocks)))} (measured: 24.0 GiB pinned per rank for 22.4)",
              "buffer")
    if prm == "cpu":
        x.add("host", f"parameters, {8 * b}-bit, defragmentation copy", b * x.param_n,
              f"{b} B x {x.shard(x.param_n)}: made once at start; the pinned cache keeps it (measured)", "buffer")
    if prm == "nvme":
        count, size = spec.offload_param.buffer_count, spec.offload_param.buffer_size
        x.add("host", "param NVMe swap buffers (pinned)", count * size * b, f"{count} x {_count(size)} x {b} B",
              "buffer")


def gather_terms(x: Breakdown) -> None:
    """ZeRO-3 gathers parameters module by module (persistent small ones stay whole); gradients are reduced through
    a bucket."""
    b, H, P, shape, spec = x.b, x.H, x.P, x.shape, x.spec
    if gathers_are_views(spec, x.hardware):
        x.notes.append("one GPU: ZeRO-3's gathers are views of the parameters' partition, no gather buffers"
                       + (" (every parameter persists: no per-module fetch)"
                          if persists_every_parameter(spec, shape) else ""))
    elif x.stage == 3:
        threshold = _resolve(spec.param_persistence_threshold, 10 * H)
        small = shape.persistent_params(min(threshold, 10 * H))
        large = shape.persistent_params(threshold) - small
        if small:
            x.add("gpu", "persistent small params + grads (norms)", 2 * b * small,
                  f"2 x {b} B x {_count(small)}: the tensors of at most {_count(min(threshold, 10 * H))} elements "
                  "(norms, biases)", "buffer")
        if large:
            x.add("gpu", "persistent weights, whole on every GPU", b * large,
                  f"{b} B x {_count(large)}: the weight tensors of at most {_count(threshold)} elements "
                  "(stage3_param_persistence_threshold) stay gathered beside their partitions", "buffer")
        prefetch = _resolve(spec.prefetch_bucket_size, int(0.9 * H * H))
        live = min(P, max(spec.max_live_parameters, shape.largest_module_params + prefetch))
        x.add("gpu", "gathered params (live)", b * live,
              f"{b} B x {_count(live)}: max_live_parameters, or largest module {_count(shape.largest_module_params)}"
              f" + prefetch {_count(prefetch)} if larger, at most P", "buffer", phase="backward")
    if x.stage == 3:  # on one GPU too: a module's gradient is whole before it goes to the partition
        x.add("gpu", "gathered grads (largest module)", b * shape.largest_module_params,
              f"{b} B x {_count(shape.largest_module_params)}", "buffer", phase="backward")
    reduce_bucket = _resolve(spec.reduce_bucket_size, H * H)
    x.add("gpu", "reduce bucket", b * reduce_bucket, f"{b} B x {_count(reduce_bucket)}", "buffer")


def activation_terms(x: Breakdown) -> None:
    """The activations of one micro batch: what the layers keep for backward (all of it, checkpointed inputs, or
    offloaded to the host), the loss's, and backward's working set beyond the loss's peak."""
    b, H, spec, training = x.b, x.H, x.spec, x.training
    per_layer = layer_activation_bytes(x.shape, spec.precision, training.seq_len, training.attention, training.liger)
    stored = lora_layer_activation_bytes(x.shape, spec, training)  # what a layer keeps; per_layer: its gradients
    final_norm = b * H + 4 if training.liger else 4 * H + 2 * b * H
    if x.lora and not training.liger:  # frozen norm and lm_head: the norm's fp32 input only
        final_norm = 4 * H
    work, work_text = kept_activation_terms(x, stored, per_layer, final_norm)
    if spec.activation_offload:
        activation_offload_terms(x, stored, final_norm)
    logits = loss_terms(x)
    t = training.tokens
    x.add("gpu", "backward working set beyond the logits peak", t * max(0, work - logits),
          f"{t} tokens x max(0, {work_text} - {logits} B)", "activation", phase="backward")


def kept_activation_terms(x: Breakdown, stored: int, per_layer: int, final_norm: int) -> tuple[int, str]:
    """What the layers keep on the GPU for backward, by activation checkpointing and offload. Returns backward's
    working set per token (a recomputed layer and its gradients, or one layer's gradients) and its formula."""
    b, H, L, t, spec = x.b, x.H, x.shape.layers, x.training.tokens, x.spec
    layer_text = f"{stored} B/layer ({x.training.attention}" + (", LoRA" if x.lora else "") + ")"
    if spec.activation_checkpointing and spec.activation_offload:
        n = min(L, OFFLOAD_IN_FLIGHT_LAYERS)
        x.add("gpu", "activations: checkpointed layer inputs in flight (rest offloaded)", t * n * b * H,
              f"{t} tokens x {n} layers x {b} B x {H}", "activation", phase="backward")
        return recomputed_layer_backward(x, stored, per_layer)
    if spec.activation_checkpointing:
        n = L if spec.checkpointed_layers is None else min(L, spec.checkpointed_layers)
        x.add("gpu", "activations: checkpointed layer inputs", t * (n * b * H + final_norm),
              f"{t} tokens x ({n} layers x {b} B x {H} + final norm {final_norm} B)", "activation", phase="backward")
        if n < L:  # gradient_checkpointing_layers: the last L - n layers keep everything
            x.add("gpu", f"activations: {L - n} layers stored (not checkpointed)", t * (L - n) * stored,
                  f"{t} tokens x {L - n} x {layer_text}", "activation", phase="backward")
        return recomputed_layer_backward(x, stored, per_layer)
    if spec.activation_offload:
        x.add("gpu", "activations: one layer in flight (rest offloaded)", t * stored,
              f"{t} tokens x {layer_text}", "activation", phase="backward")
        return per_layer, f"one layer's gradients: {per_layer} B"
    x.add("gpu", f"activations: {L} layers stored", t * (L * stored + final_norm),
          f"{t} tokens x ({L} x {layer_text} + final norm {final_norm} B)", "activation", phase="backward")
    return per_layer, f"one layer's gradients: {per_layer} B"


def recomputed_layer_backward(x: Breakdown, stored: int, per_layer: int) -> tuple[int, str]:
    """Backward's working set per token through a checkpointed layer, and its formula: the recomputed layer's saved
    tensors and its gradients (with Liger on a dense model, two hidden-wide ones: LIGER_BACKWARD_HIDDEN_GRADIENTS)."""
    if x.training.liger and not x.shape.experts:
        grads = LIGER_BACKWARD_HIDDEN_GRADIENTS * x.b * x.H
        return stored + grads, (f"recomputed layer + {LIGER_BACKWARD_HIDDEN_GRADIENTS} hidden-wide gradients: {stored}"
                                f" + {LIGER_BACKWARD_HIDDEN_GRADIENTS} x {x.b} B x {x.H}")
    return stored + per_layer, f"recomputed layer + its gradients: {stored} + {per_layer} B"


def activation_offload_terms(x: Breakdown, stored: int, final_norm: int) -> None:
    """Activation offload's pinned host term and its PCIe time (a note)."""
    b, H, L, t = x.b, x.H, x.shape.layers, x.training.tokens
    pinned, pinned_text = None, ""
    if x.spec.activation_checkpointing:  # L + 1 tensors of t x b x H (layer inputs, final norm input) + the rest
        block, rest = pinned_block_bytes(t * b * H), pinned_block_bytes(t * (final_norm - b * H))
        pinned = (L + 1) * block + rest
        pinned_text = (f"{L + 1} x {t * b * H} B layer inputs in {block} B pinned blocks + final norm's "
                       f"{t * (final_norm - b * H)} B in {rest} B: powers of two")
    x.notes.append(_offload_activations(x.terms, t, L * (b * H if x.spec.activation_checkpointing else stored)
                                        + final_norm, x.training.grad_accum, x.g, pinned, pinned_text))


def loss_terms(x: Breakdown) -> int:
    """The loss's memory: TRL's fused LM head (`plan.lm_head`), Liger's fused linear cross-entropy, or the whole fp32
    logits. Returns the logits' bytes per token (0 unless whole), which backward's working set reuses."""
    b, H, t, vocab = x.b, x.H, x.training.tokens, x.shape.vocab
    if lm_head.fused(x.training):  # trl.trainer.utils.add_fused_lm_head: tiles, recomputed in backward
        held, formula = lm_head.fused_bytes(t, H, vocab, b, head_trains=not x.lora)
        x.add("gpu", "fused LM head + loss (TRL, in tiles)", held, formula, "activation", phase="backward")
        return lm_head.freed_per_token(held, t, H, b)  # gone before the layers' backward, as the logits are
    if x.training.liger:  # liger_kernel.ops.fused_linear_cross_entropy: logits chunk by chunk, gradients in forward
        chunk = min(t, 1 << max(0, math.ceil(t / math.ceil(vocab / H)) - 1).bit_length())
        head = 0 if x.lora else b * vocab * H  # a frozen lm_head gets no gradient
        x.add("gpu", "fused linear cross-entropy (Liger)", b * t * H + 4 * t + head + b * chunk * vocab,
              f"{b} B x {t} tokens x {H} (input grad) + fp32 loss per token + "
              + (f"{b} B x vocab {vocab} x {H} (lm_head grad)" if head else "no lm_head grad (frozen)")
              + f" + a {chunk}-token chunk of {b}-byte logits", "activation", phase="backward")
        return 0
    logits = LOGITS_BYTES_PER_VOCAB * vocab
    x.add("gpu", "logits + loss (fp32 cross-entropy)", t * logits, f"{t} tokens x 12 B x vocab {vocab}",
          "activation", phase="backward")
    return logits


def gpu_overhead_terms(x: Breakdown) -> None:
    """GPU memory beyond what is allocated: the allocator's fragmentation (measured per stage; what the GPU leaves
    when that is less but still enough near full) and the CUDA context."""
    hardware, stage = x.hardware, x.stage
    allocated = Plan(x.shape, hardware, x.training, x.spec, tuple(x.terms)).gpu_allocated_bytes
    fixed = hardware.fixed
    margin, tight = dict(fixed.gpu_margin)[stage], dict(fixed.gpu_margin_near_full).get(stage)
    if x.lora and stage in dict(fixed.gpu_margin_lora):  # little step churn: an adapter-sized partition
        margin, tight = dict(fixed.gpu_margin_lora)[stage], None
    left = hardware.usable(hardware.gpu_mem) - fixed.cuda_context - allocated
    if tight is not None and tight * allocated <= left < margin * allocated:
        x.add("gpu", "allocator fragmentation margin", left, f"what the GPU leaves: {left / allocated:.1%} of "
              f"allocated (near full: at least {tight:.0%}, measured; {margin:.0%} with room)", "overhead", False)
        x.notes.append(f"tight fit: {left / allocated:.1%} of allocated left for fragmentation (measured need near a "
                       f"full GPU: {tight:.0%}); the allocator will release cached blocks, which can cost some speed")
    else:
        x.add("gpu", "allocator fragmentation margin", margin * allocated, f"{margin:.0%} of allocated at the peak",
              "overhead", False)
    x.add("gpu", "CUDA context + NCCL buffers", fixed.cuda_context, f"NVML used - torch reserved: {fixed.source}",
          "overhead", False)


def host_terms(x: Breakdown) -> None:
    """Host RAM per node beyond offloaded states: the processes, the save's gather, loading the weights, a margin,
    and ZeRO-3's start-up peak."""
    b, P, T, g, stage, shape = x.b, x.P, x.T, x.g, x.stage, x.shape
    fixed = x.hardware.fixed
    x.add("host", "training processes", fixed.host_per_rank, f"{gb(fixed.host_per_rank)} per rank", "overhead")
    if stage == 3 and x.lora:  # the Trainer gathers a peft model's trainable parameters only, whatever the setting
        x.terms.append(Term("16-bit adapter gathered on rank 0 to save", "host", b * T,
                            f"{b} B x {_count(T)} at every save (the frozen base is not saved)", "buffer"))
    elif stage == 3 and x.spec.gather_16bit_weights_on_save:
        x.terms.append(Term("16-bit model gathered on rank 0 to save", "host", b * P,
                            f"{b} B x {_count(P)} at every save (checkpoints, the final model): "
                            "stage3_gather_16bit_weights_on_model_save; on the first node only (measured, 10.7B on "
                            "1 x H200: +20.2 GiB for 20.0)", "buffer"))
    loading, load_b = (shape.largest_module_params if stage == 3 else P), x.training.load_bytes or b
    copies = MOE_LOAD_COPIES if stage == 3 and shape.experts else 1
    x.add("host", "loading weights", copies * load_b * loading, f"{copies} x " * (copies > 1) + f"{load_b} B x "
          f"{_count(loading)}" + ((" (ZeRO-3 loads one MoE block at a time: its per-expert tensors and their fused "
                                   "copy)" if copies > 1 else " (ZeRO-3 loads one tensor at a time)") if stage == 3 else
                                  " (each rank loads the whole model)"), "buffer")
    host = sum(term.bytes for term in x.terms if term.where == "host")
    x.terms.append(Term("host margin", "host", int(HOST_MARGIN * host), f"{HOST_MARGIN:.0%} of the above", "overhead"))
    if stage == 3 and x.prm == "none":  # before the first step, while no offloaded state exists yet
        x.terms.append(Term("start-up: ranks at rest", "host", g * STARTUP_RANK_BYTES,
                            f"{gb(STARTUP_RANK_BYTES)} x {g} GPUs/node (measured: the 7b's rank beside its copy below)",
                            "overhead", phase="startup"))
        x.terms.append(Term("start-up: 16-bit partitions packed through host memory", "host", g * b * x.tpart,
                            f"{b} B x {x.shard(x.tpart, T)} x {g} GPUs/node: DeepSpeed's ZeRO-3 optimizer builds each "
                            "rank's flat 16-bit buffer through a host tensor (`defragment`, runtime/zero/utils.py); "
                            "measured on 1 x H200: 13.74 GiB held by the 7b's rank for 12.55 GiB of partitions",
                            "buffer", phase="startup"))


def persists_every_parameter(spec: ZeroSpec, shape: ModelShape) -> bool:
    """Whether ZeRO-3's persistence threshold keeps every tensor of this model whole (EVERY_PARAMETER, or any value
    at least its largest tensor)."""
    threshold = _resolve(spec.param_persistence_threshold, 10 * shape.hidden)
    return spec.stage == 3 and shape.persistent_params(threshold) == shape.params


def gathers_are_views(spec: ZeroSpec, hardware: Hardware) -> bool:
    """ZeRO-3 on one rank with the parameters on the GPU: a "gather" makes the parameter a view of its partition
    (DeepSpeed 0.19 `_no_gather_coalesced`), so gathered and persistent parameters take no memory of their own."""
    return spec.stage == 3 and hardware.world_size == 1 and spec.offload_param.device == "none"
