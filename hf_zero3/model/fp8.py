"""FP8 matmuls in the decoder layers (`fp8: true`), with torchao's float8 training.

Each `nn.Linear` inside a decoder layer becomes torchao's `Float8Linear`: its input, weight and output gradient are
cast to float8 with dynamic scales (recipe `tensorwise`: one scale per tensor; `rowwise`: one per row) and multiplied
on the GPU's FP8 tensor cores. The weights, their gradients and the optimizer states keep their dtypes and names, so
ZeRO-3 partitions them, and checkpoints and exports hold them, as without FP8. The embedding, the lm_head (its
logits feed the loss) and a mixture of experts' routers keep their own dtype, as torchtitan keeps them.

It needs `regional_compile`: uncompiled, every cast is a kernel of its own, and `Float8Linear` saves a view of the
weight (`weight.t()`) for backward, which under ZeRO-3 keeps each gathered weight alive after the partitioner
released it, until backward. Compiled, the casts fuse into the layer's graph and the graph saves the parameter
itself, which ZeRO-3 gathers again for backward (tests/unit/test_fp8.py checks what is saved).
Off by default, and not a planner choice until a committed loss curve matches bf16 within the spread of two seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_zero3.model.layers import checkpointing_layers
from hf_zero3.plan.experts import expert_count

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 recipes (`Float8LinearConfig.from_recipe_name`): tensorwise is the fastest; the rowwise ones
scale each row (rowwise_with_gw_hp keeps the weight gradient's matmul in 16 bit), more accurate, slower."""

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada: L4, L40S; Hopper 9.0: H100, H200; Blackwell)."""

ALIGNMENT = 16
"""FP8 matmuls (`torch._scaled_mm`) need both dimensions of the weight divisible by 16: other linears keep their
dtype."""


def converts(module: torch.nn.Module, name: str, layer_names: tuple[str, ...], experts: int) -> bool:
    """Whether the linear `name` becomes FP8: inside a decoder layer (`layer_names`), aligned, and not a router (a
    linear with one output per expert, `experts` > 0)."""
    return (isinstance(module, torch.nn.Linear) and name.startswith(layer_names)
            and module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0
            and not (experts and module.out_features == experts))


def enable(model: torch.nn.Module, recipe: str = "tensorwise", emulate: bool = False) -> list[str]:
    """Swap the decoder layers' linears of `model` for torchao's Float8Linear, in place; returns their names.
    `emulate` (on CPU, which has no FP8 matmul: torch's fallback takes about a second per matmul): the same casts,
    multiplied in high precision, FP8's numerics without its speed. ValueError for a model without transformers'
    decoder layers or an unknown recipe."""
    # only when asked: torchao is optional
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in RECIPES:
        raise ValueError(f"fp8_recipe {recipe!r}: choose one of {', '.join(RECIPES)}")
    layers = {id(layer) for layer in checkpointing_layers(model)}
    layer_names = tuple(f"{name}." for name, module in model.named_modules() if id(module) in layers)
    if not layer_names:
        raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer blocks: fp8 converts the linear "
                         "layers of transformers' decoder layers; drop fp8")
    experts = expert_count(model.config)
    converted = [name for name, module in model.named_modules() if converts(module, name, layer_names, experts)]
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, name: converts(module, name, layer_names, experts))
    return converted


def problems(values: dict[str, Any], device: str) -> list[str]:
    """What stops `fp8: true` with these arguments on `device` ("cuda" or "cpu"), before anything starts."""
    if not values.get("fp8"):
        return []
    found = []
    if values.get("fp8_recipe", "tensorwise") not in RECIPES:
        found.append(f"fp8_recipe {values['fp8_recipe']!r}: choose one of {', '.join(RECIPES)}")
    if not values.get("regional_compile"):
        found.append("fp8 needs regional_compile: true: uncompiled, each float8 cast is a kernel of its own (slower "
                     "than bf16) and, under ZeRO-3, every gathered weight stays alive until backward; set "
                     "regional_compile true")
    elif values.get("regional_compile_backend") == "eager":
        found.append("fp8 with regional_compile_backend eager keeps views of the gathered weights for backward, as "
                     "uncompiled (only AOTAutograd's graphs save the weights themselves): use inductor or aot_eager")
    if values.get("peft") is not None:
        found.append("fp8 with a peft adapter is not supported: drop fp8 (LoRA trains few weights; its frozen base "
                     "matmuls stay bf16) or drop the peft block")
    if values.get("fp16"):
        found.append("fp8 with fp16 is not supported: torchao's float8 training casts from bf16 or fp32 (fp16's loss "
                     "scaling is not made for it); use bf16 true instead of fp16")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        found.append(f"fp8 needs torchao ({e}): pip install torchao (or pip install 'hf_zero3[fp8]')")
    if device == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < FP8_CAPABILITY:
            found.append(f"fp8 needs FP8 tensor cores (compute capability {'.'.join(map(str, FP8_CAPABILITY))}+: "
                         f"L40S, H100, H200, ...); {torch.cuda.get_device_name()} has "
                         f"{'.'.join(map(str, capability))}: drop fp8")
    return found
