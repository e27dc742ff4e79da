"""A LoRA adapter on a model shape, as the planner counts it (`Training.adapter`): the parameters it adds (what trains
in a LoRA run) and the layers it adapts (what changes the activations, `plan.memory.lora_layer_activation_bytes`).

Pure arithmetic over the shape, like the rest of the planner: each adapted linear layer of `in` inputs and `out`
outputs gets A (r x in) and B (out x r), r x (in + out) parameters (peft, bias "none"); a test checks the count
against peft's own on a real model.
"""

from __future__ import annotations

from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.types import Adapter, PlanError

ALL_LINEAR = "all-linear"


LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of one decoder layer the planner knows (Llama family; lm_head is not adapted)."""


def linear_layers(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """{name: (inputs, outputs)} of each of the LINEAR_LAYERS of one decoder layer."""
    h, q, kv, ffn = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    widths = ((h, q), (h, kv), (h, kv), (q, h), (h, ffn), (h, ffn), (ffn, h))
    return dict(zip(LINEAR_LAYERS, widths, strict=True))


def target_names(shape: ModelShape, targets: str | list[str] | tuple[str, ...] = ALL_LINEAR) -> tuple[str, ...]:
    """The linear layers `targets` (module names, or "all-linear") adapts in each decoder layer, each once."""
    layers = linear_layers(shape)
    names = tuple(layers) if targets == ALL_LINEAR else tuple(dict.fromkeys(targets))
    if unknown := [n for n in names if n not in layers]:
        raise PlanError(f"LoRA targets {', '.join(unknown)}: the planner knows the linear layers "
                        f"{', '.join(layers)} (or {ALL_LINEAR})")
    return names


def adapter_params(shape: ModelShape, r: int, targets: str | list[str] | tuple[str, ...] = ALL_LINEAR) -> int:
    """Parameters of a rank-`r` LoRA adapter on `targets` (module names, or "all-linear") of every layer."""
    layers, names = linear_layers(shape), target_names(shape, targets)
    if r < 1:
        raise PlanError(f"LoRA rank must be >= 1 (got {r})")
    return shape.layers * sum(r * sum(layers[n]) for n in names)


def adapter(shape: ModelShape, r: int, targets: str | list[str] | tuple[str, ...] = ALL_LINEAR,
            dropout: float = 0.0, params: int | None = None) -> Adapter:
    """The rank-`r` adapter on `targets` with `dropout` (peft's `lora_dropout`), as `Training.adapter`; `params`: a
    built model's own count, when there is one (else `adapter_params`)."""
    names = target_names(shape, targets)
    count = adapter_params(shape, r, names) if params is None else params
    return Adapter(count, r, names, dropout > 0)
