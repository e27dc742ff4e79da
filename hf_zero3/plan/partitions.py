"""How ZeRO splits the training states over the ranks: each parameter's partition, the optimizer's sub-groups, which
of them partial offload keeps on the GPU, and the pinned host blocks optimizer offload allocates. Pure arithmetic
(DeepSpeed 0.19's rules), asked by the memory model and the chooser."""

from __future__ import annotations

import itertools
import math

from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.shapes import ModelShape


def gpu_kept_optimizer_elements(spec: ZeroSpec, state_n: int,
                                 partitions: list[int] | None = None) -> tuple[int, int, int]:
    """Partial offload (`offload_optimizer.ratio` < 1): elements per rank whose fp32 states stay on the GPU, the
    rank's sub-groups, and how many of them stay. DeepSpeed 0.19 keeps sub-group i on the GPU when
    i < int((1 - ratio) x sub-groups), so the split moves in whole sub-groups: one sub-group keeps nothing."""
    opt = spec.offload_optimizer
    if spec.stage != 3 or opt.device != "cpu" or opt.ratio >= 1:
        return 0, 1, 0
    sizes = sub_groups(spec, state_n, partitions)
    kept_groups = int((1 - opt.ratio) * len(sizes))
    return sum(sizes[:kept_groups]), len(sizes), kept_groups


def rank_partitions(shape: ModelShape, world: int) -> list[int]:
    """Each parameter's elements on one rank, in the model's order: ZeRO-3 pads every tensor to a multiple of the
    world size (`partition_numel`)."""
    return [math.ceil(n / world) for n in shape.parameter_order()]


def sub_groups(spec: ZeroSpec, state_n: int, partitions: list[int] | None = None) -> list[int]:
    """Elements of each optimizer sub-group of a rank. DeepSpeed (`_create_fp16_sub_groups`) walks the parameters in
    order and closes a sub-group at the first one that takes it to >= sub_group_size, so a model of large tensors (a
    mixture of experts' fused experts) makes fewer, larger groups. With the rank's `partitions` in order that walk is
    repeated exactly; without (a LoRA adapter), groups are taken as full, a remainder of 5% or more as a group of its
    own (the 8b probe: 4.015B elements per rank made 4 groups, measured through their pinned blocks)."""
    if partitions is not None:
        if spec.sub_group_size >= sum(partitions):
            return [sum(partitions)]
        groups, size = [], 0
        for n in partitions:
            size += n
            if size >= spec.sub_group_size:
                groups.append(size)
                size = 0
        return groups + ([size] if size else [])
    full, rest = divmod(state_n, spec.sub_group_size)
    if full == 0:
        return [state_n]
    if rest < 0.05 * spec.sub_group_size:
        return [state_n // full] * (full - 1) + [state_n - (state_n // full) * (full - 1)]
    return [spec.sub_group_size] * full + [rest]


def round_up_to_power_of_2(n: int) -> int:
    """`n` rounded up to a power of two (at least 1): what torch's caching host allocator pins for a block of `n` bytes."""
    return 1 << max(0, int(n) - 1).bit_length()


def pinned_blocks(spec: ZeroSpec, grad_bytes: int, state_n: int, kept: int,
                  partitions: list[int] | None = None) -> list[int]:
    """Bytes of each pinned host block ZeRO-3 with optimizer offload allocates per rank (DeepSpeed 0.19 stage3.py):
    the flat 16-bit gradient partition; with device "cpu" one fp32 gradient buffer per CPU sub-group, and one more
    block of a sub-group's size if some sub-groups stay on the GPU (their pinned staging copy, freed into torch's
    cache and kept there). With "nvme" only the gradient partition: the optimizer's swap buffers are page-locked by
    DeepSpeed's aio handle (`new_cpu_locked_tensor`: posix_memalign + mlock, swap_tensor/utils.py), not by torch's
    caching host allocator, so they are not rounded (measured, 70B width on 2 x H200: torch's pinned peak 4.0 GiB per
    rank = the 2.2 GB gradient partition rounded; benchmarks study nvme-offload-70b-width)."""
    if spec.offload_optimizer.device == "nvme":
        return [grad_bytes]
    sizes = sub_groups(spec, state_n, partitions)
    kept_groups = len([None for total in itertools.accumulate(sizes) if total <= kept]) if kept else 0
    return [grad_bytes] + [4 * n for n in sizes[kept_groups:]] + ([4 * max(sizes)] if kept else [])
