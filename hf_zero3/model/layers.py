"""The model's repeated blocks (transformers' `GradientCheckpointingLayer`): what partial checkpointing, FP8 and
regional compile act on, and the check of `gradient_checkpointing_layers` against their number."""

from __future__ import annotations

import torch


def checkpointing_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks that checkpoint themselves (transformers' `GradientCheckpointingLayer`), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checked_layers(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """The model's checkpointing layers; ValueError, naming the fix, when `count` is not between 1 and their number."""
    layers = checkpointing_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer blocks: gradient_checkpointing_layers "
                         "works on transformers' decoder models; drop it")
    if not 1 <= count <= len(layers):
        n = len(layers)
        raise ValueError(f"gradient_checkpointing_layers is {count}, but {type(model).__name__} has {n} checkpointable "
                         f"layers: set it between 1 and {n} ({n} checkpoints them all)")
    return layers
