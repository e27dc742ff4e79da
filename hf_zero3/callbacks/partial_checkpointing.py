"""Checkpoint only the first N decoder layers (Megatron's `recompute_num_layers` with `recompute_method=block`).

Why: activation checkpointing is all or nothing in the Trainer (transformers >= 5.24 adds `every_n_layers`, which
checkpoints 1 of every n layers: half at best). On a GPU where full checkpointing leaves memory over, keeping the
activations of a few layers skips their recompute (a layer's forward, about 1/4 of its step time) at a known memory
cost: `layers x micro batch x sequence x (a layer's saved activations - its input)`. Measured on one H200
(benchmarks study partial-ckpt-7b-1gpu; the 7b recipe's README).

How: the Trainer turns checkpointing on for every `GradientCheckpointingLayer` when `train()` starts, before the
callbacks' `on_train_begin`; this callback then turns it off again on all but the first N of them. Each layer reads
its own `gradient_checkpointing` flag at every forward, so nothing else changes: the model, DeepSpeed and the
Trainer stay stock, and any script can add it (`trainer.add_callback(PartialCheckpointingCallback(24))`).
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from hf_zero3.model.layers import checked_layers


def checkpoint_first(model: torch.nn.Module, count: int) -> int:
    """Leave checkpointing on for the first `count` layers and turn it off for the rest; returns how many layers
    keep their activations. Raises ValueError when `count` is not between 1 and the model's layer count."""
    layers = checked_layers(model, count)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < count
    return len(layers) - count


class PartialCheckpointingCallback(TrainerCallback):
    """Checkpoint only the first `count` decoder layers; needs the Trainer's `gradient_checkpointing` on."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"gradient_checkpointing_layers must be >= 1 (got {count}); to checkpoint no layer set "
                             "gradient_checkpointing false")
        self.count = count

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not (getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)):
            raise ValueError("gradient_checkpointing_layers needs gradient_checkpointing true: it chooses which layers "
                             "the Trainer's checkpointing covers")
        kept = checkpoint_first(model, self.count)
        if state.is_world_process_zero:
            print(f"hf_zero3: activation checkpointing on the first {self.count} layers; the last {kept} keep "
                  "their activations (gradient_checkpointing_layers)", flush=True)
