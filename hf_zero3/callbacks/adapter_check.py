"""After each save of a LoRA run: the saved adapter is the trained one, with its real shapes and the trained norms."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.checkpoint.contents import adapter_key, verify_adapter
from hf_zero3.checkpoint.lifecycle import CheckpointError, checkpoint_dir
from hf_zero3.job.distributed import gather_from_ranks


class AdapterCheckCallback(TrainerCallback):
    """Refuse a checkpoint whose adapter is not what was trained.

    Why: under ZeRO-3 each rank holds a slice of every adapter tensor and the module itself sees
    `torch.Size([0])` placeholders; a save that takes the module's state dict instead of gathering writes empty
    tensors (or zeros), and nothing in the Trainer notices. Here, after each save, every rank adds up the squares
    of its slices (one all-reduce of a few floats, no gather) and rank 0 compares the saved adapter with those
    shapes and norms (`hf_zero3.checkpoint.contents.verify_adapter`). It must come before
    CheckpointGuardCallback: a save refused here never gets its completion marker, so it is never resumed from,
    exported or pushed.
    """

    def on_save(self, args, state, control, model=None, **kwargs):
        folder = checkpoint_dir(args.output_dir, state.global_step)
        if problems := verify_on_all_ranks(model, folder):
            raise CheckpointError(f"{folder}: the saved adapter is not the trained one: {'; '.join(problems[:5])}. "
                                  "It has no completion marker, so it is never resumed from")


def verify_on_all_ranks(model, folder: str | Path) -> list[str]:
    """Problems with the adapter saved in `folder` against `model`'s (every rank calls this; all get the answer)."""
    import torch.distributed as dist

    expected = trained_adapter(model)
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    mine = verify_adapter(folder, expected) if rank0 else []
    return [p for record in gather_from_ranks({"problems": mine}) for p in record["problems"]]


def trained_adapter(model) -> dict[str, tuple[tuple[int, ...], float]]:
    """{saved key: (shape, norm)} of the parameters that train (the adapter), on every rank.

    A ZeRO-3 parameter's norm is summed from the ranks' slices (`ds_tensor`; its padding is zeros); a slice that is
    swapped out to NVMe on any rank makes every rank gather that tensor instead."""
    import torch
    import torch.distributed as dist

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    on = dist.is_available() and dist.is_initialized()
    rank0 = not on or dist.get_rank() == 0
    device = torch.device("cuda", torch.cuda.current_device()) if on and dist.get_backend() == "nccl" else "cpu"
    squares = torch.zeros(2 * len(named), dtype=torch.float64, device=device)  # sums of squares, then "swapped out"
    for i, (_, p) in enumerate(named):
        if hasattr(p, "ds_tensor"):
            if p.ds_tensor.numel() == 0 and p.ds_numel > 0:
                squares[len(named) + i] = 1
            else:
                squares[i] = p.ds_tensor.detach().double().pow(2).sum()
        elif rank0:  # whole on every rank (no ZeRO-3): counted once
            squares[i] = p.detach().double().pow(2).sum()
    if on:
        dist.all_reduce(squares)
    for i, (_, p) in enumerate(named):
        if squares[len(named) + i] > 0:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                squares[i] = p.detach().double().pow(2).sum()
    return {adapter_key(name): (tuple(getattr(p, "ds_shape", p.shape)), float(squares[i].sqrt()))
            for i, (name, p) in enumerate(named)}
