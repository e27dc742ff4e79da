"""The names and shapes a model's parameters take in its saved weights.

transformers 5 converts some layouts when it loads weights and converts them back when it saves: a mixture of
experts' per-expert matrices (`experts.0.w1.weight`, ...) are fused into one 3-D tensor per block in memory
(`experts.gate_up_proj`), and Mixtral's `block_sparse_moe` is `mlp` in memory. DeepSpeed's checkpoint lists the
parameters as they are in memory; `save_pretrained` writes the saved layout. Checking a save against what trained, and
exporting ZeRO shards as `save_pretrained` would, both need that reverse conversion: transformers' own
(`revert_weight_conversion`), run on a model built on the meta device from the checkpoint's config.json.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def meta_model(folder: str | os.PathLike):
    """The model of `folder`'s config.json on the meta device (no memory, no weights); None when it cannot be built
    (no config, a model class transformers does not ship)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(folder) / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"), _without_zero3_init():
            return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, ImportError):
        return None


@contextlib.contextmanager
def _without_zero3_init():
    """Inside a ZeRO-3 run transformers builds every model under `deepspeed.zero.Init`, which partitions it with
    collectives: rank 0 alone building this meta model would wait for the other ranks forever."""
    from transformers.integrations import deepspeed as hf_deepspeed

    active = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = active


def to_saved_layout(model, state_dict: dict) -> dict:
    """`state_dict` (names as in memory) in the layout `save_pretrained` writes for `model`; unchanged for models
    transformers loads as they are saved. Works on meta tensors, so shapes alone can be converted."""
    if model is None:
        return state_dict
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state_dict))


def saved_shapes(folder: str | os.PathLike, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """In-memory parameter `shapes` renamed and reshaped into the saved layout of the model in `folder`."""
    import torch

    model = meta_model(folder)
    if model is None:
        return shapes
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    return {name: tuple(t.shape) for name, t in to_saved_layout(model, meta).items()}
