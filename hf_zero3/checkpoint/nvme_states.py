"""The fp32 weights of a ZeRO-3 checkpoint whose optimizer states were swapped to NVMe (ZeRO-Infinity).

Why: with `offload_optimizer.device: nvme`, every sub-group DeepSpeed swaps holds its fp32 master weights in a
swap file, not in memory; the checkpoint's optimizer file then saves that sub-group as an empty tensor (named by
its `ds_id`), and `engine.save_checkpoint` copies the swap files to `global_stepN/offloaded_tensors/rank<NN>/`.
DeepSpeed's `zero_to_fp32` reads only the optimizer files, so it fails ("consumed N numels out of 0") or, with a
sub-group in memory, would misplace every weight after the first swapped one. Found exporting the 70b recipe's
checkpoint on one H200 (2026-12-01). This fills each empty sub-group from its file, memory-mapped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hf_zero3.checkpoint.contents import model_states_files
from hf_zero3.checkpoint.lifecycle import CheckpointError

OFFLOADED = "offloaded_tensors"


def has_nvme_states(tag_dir: Path) -> bool:
    """Whether the DeepSpeed tag folder (`global_stepN`) holds optimizer states swapped to NVMe."""
    return (Path(tag_dir) / OFFLOADED).is_dir()


def sub_group_numels(tag_dir: Path, world_size: int) -> list[int]:
    """Each sub-group's fp32 elements on one rank: its parameters' ZeRO-3 partitions (ceil(numel / world size)),
    from `param_shapes`, which the model-states file keeps per sub-group in the optimizer's order."""
    import torch

    files, _ = model_states_files(Path(tag_dir), 0)
    if not files:
        raise CheckpointError(f"{tag_dir} has no *_model_states.pt: export another complete checkpoint")
    states = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    return [sum(math.ceil(shape.numel() / world_size) for shape in group.values()) for group in states["param_shapes"]]


def fill_swapped(tag_dir: Path, rank: int, groups: list, numels: list[int]) -> list:
    """`groups` (one rank's fp32 sub-groups) with each empty one replaced by its swap file's first numel values."""
    import torch

    if len(groups) != len(numels):
        raise CheckpointError(f"{tag_dir}: rank {rank} saved {len(groups)} fp32 sub-groups but the model states "
                              f"name {len(numels)}: the checkpoint's files are from different runs")
    folder = Path(tag_dir) / OFFLOADED / f"rank{rank:02d}"
    filled = []
    for index, (group, numel) in enumerate(zip(groups, numels)):
        if group.numel() or not numel:
            filled.append(group)
            continue
        path = folder / f"{getattr(group, 'ds_id', '?')}.tensor.swp"
        need = numel * group.element_size()
        if not path.is_file() or path.stat().st_size < need:
            found = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise CheckpointError(f"{tag_dir}: rank {rank}'s fp32 sub-group {index} was swapped to NVMe, but its "
                                  f"copy {path} is {found} (needs {need} bytes): export another complete checkpoint")
        filled.append(torch.from_file(str(path), shared=False, size=numel, dtype=group.dtype))
    return filled


@contextmanager
def swapped_fp32_groups(tag_dir: Path) -> Iterator[None]:
    """Within this block, DeepSpeed's `zero_to_fp32` reads swapped sub-groups from `offloaded_tensors/`."""
    from deepspeed.utils import zero_to_fp32

    original = zero_to_fp32.parse_optim_states

    def parse_optim_states(files, ds_checkpoint_dir):
        stage, world_size, fp32_groups, paddings = original(files, ds_checkpoint_dir)
        if stage == 3:
            numels = sub_group_numels(tag_dir, world_size)
            fp32_groups = [fill_swapped(tag_dir, rank, groups, numels) for rank, groups in enumerate(fp32_groups)]
        return stage, world_size, fp32_groups, paddings

    zero_to_fp32.parse_optim_states = parse_optim_states
    try:
        yield
    finally:
        zero_to_fp32.parse_optim_states = original
