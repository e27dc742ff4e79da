"""How many bytes a save writes, estimated from the model before the first save: pure arithmetic, as the memory
model is, asked by the checkpoint guard's disk check when training starts and by `hf-zero3 plan`'s saves line.

Why: the guard's check before each save compares the disk with the newest complete checkpoint, so the first save
had nothing to compare with. A disk too small for it failed hours into the run, at the first checkpoint or the
final model (measured: recipe 10b-h200x1 writes ZeRO shards, 12 B x 10.7B = 129 GB, on a box with 64 GiB of disk).
Estimated from the model, it is an error when training starts instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SaveSize:
    """Bytes of one save: `sharded` is split over the ranks (ZeRO's optimizer and model states, each rank writes
    its share), `whole` is written by rank 0 alone (16-bit weights, a ZeRO-1/2 module copy)."""

    sharded: int
    whole: int

    @property
    def total(self) -> int:
        return self.sharded + self.whole

    def on_node(self, local_ranks: int, world_size: int, has_rank0: bool) -> int:
        """What lands on one node's disk when each node writes to its own disk (on a shared one: a lower bound)."""
        return self.sharded * local_ranks // max(world_size, 1) + (self.whole if has_rank0 else 0)


def moment_bytes(optimizer: str) -> int:
    """Bytes per parameter of the optimizer's state besides the weights: Adam and Lamb keep two moments.

    A lower bound for optimizers this does not know (0): the check must never refuse a run that would fit."""
    name = optimizer.lower()
    if "8bit" in name:
        return 2
    return 8 if "adam" in name or "lamb" in name else 0


def save_size(params: int, param_bytes: int, ds_config: dict | None, optimizer: str,
              gathered: bool) -> tuple[SaveSize, SaveSize]:
    """(a checkpoint, the final model) for `params` parameters of `param_bytes` each.

    DeepSpeed saves each rank's fp32 partition of the weights with the optimizer's moments (12 B per parameter
    for Adam, measured on the tiny recipe: 12.0 B), and below ZeRO-3 rank 0 also saves the 16-bit module. The
    Trainer adds the gathered weights when gathering is on (`gathered`). The final model is those weights, or,
    under ZeRO-3 without gathering, a whole DeepSpeed checkpoint (the Trainer's fallback in `save_model`).
    Without DeepSpeed: the weights and `optimizer.pt`.
    """
    weights = params * param_bytes
    moments = params * moment_bytes(optimizer)
    if ds_config is None:
        return SaveSize(0, weights + moments), SaveSize(0, weights)
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    states = params * 4 + moments
    module = weights if stage != 3 else 0
    checkpoint = SaveSize(states, module + (weights if gathered else 0))
    final = SaveSize(0, weights) if gathered else SaveSize(states, module)
    return checkpoint, final
