"""Regional compilation: `torch.compile` on each decoder layer instead of the whole model (`regional_compile: true`).

Why not the Trainer's `torch_compile: true`: it compiles the whole model, the loss included, and Liger's fused linear
cross-entropy fails under dynamo on this stack (`ZeroDivisionError` in `triton.cdiv`). Compiling only the decoder
layers keeps the embedding, the final norm, the lm_head and the loss outside dynamo, where Liger's kernels run as
they do uncompiled; inside the layers the compiler fuses the norms, the rotary embedding, the activations and the
residual adds. The layers are repeated blocks of one class, so dynamo traces one and reuses its graph for all
(torchtitan and accelerate's `compile_regions` do the same).

How: each `GradientCheckpointingLayer`'s `forward` is replaced, on the instance, by its compiled self. The module
tree, parameter names and state dict stay as they are, so checkpoints and exports see the model they know, and the
module's hooks (ZeRO-3's parameter fetch and release, FSDP2's) run around the compiled forward, outside dynamo. Under
ZeRO-3 each layer is made a "leaf" (`deepspeed.utils.set_z3_leaf_modules`): its parameters are fetched together when
the layer starts and its submodules carry no hooks, which would otherwise break the graph at every linear layer (they
are `torch.compiler.disable`d) and recompile per layer on their per-module state. Activation checkpointing wraps
each layer's call (`GradientCheckpointingLayer.__call__`), so checkpointing and `gradient_checkpointing_layers` work
unchanged. Off by default: the planner
chooses it only where it was measured faster.
"""

from __future__ import annotations

import torch

from hf_zero3.model.layers import checkpointing_layers

BACKENDS = ("inductor", "aot_eager", "eager")
"""`regional_compile_backend`: inductor (the compiler, the default), or dynamo's tracing without code generation
(aot_eager, eager), which checks that a model traces, in seconds."""

LIGER_OUTSIDE_LAYERS = {"fused_linear_cross_entropy": False, "cross_entropy": False, "rms_norm": False,
                        "swiglu": False, "rope": False}
"""Liger with compiled layers, where `liger_kernel_config` does not choose: none of its kernels inside the layers,
whose norms, activations and rotary embedding the compiler fuses; and not its fused linear cross-entropy either,
since TRL's SFTTrainer computes the loss through its own chunked LM head (the full logits are never built).
With all of Liger inside compiled layers one H200 run (torch 2.11, Liger 0.8.5) failed: inductor could not trace
Liger's RMSNorm kernel ("'float' object has no attribute 'to'") and the step then hit an illegal memory access."""


def _side_effects_run_once(forward):
    """Trace a checkpointed layer in one graph even when its forward writes Python state outside itself: the `kernels`
    package that transformers 5 uses wraps attention's forward in a set-and-reset of a global (its kernel routing),
    which dynamo otherwise refuses inside the checkpoint operator, breaking the graph at every checkpointed layer. The
    write is undone before the forward returns, so not replaying it when backward recomputes the layer changes
    nothing."""
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)(forward)


def enable(model: torch.nn.Module, backend: str = "inductor") -> list[torch.nn.Module]:
    """Compile each decoder layer's forward of `model` in place; returns the layers. ValueError, naming the fix, for a
    model without transformers' decoder layers."""
    layers = checkpointing_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer blocks: regional_compile compiles "
                         "transformers' decoder layers; drop it (or use torch_compile for the whole model)")
    from deepspeed.utils import set_z3_leaf_modules  # deepspeed takes seconds to import: only when compiling

    # ZeRO-3 then fetches a layer's parameters in one go at the layer and hooks none of its modules: nothing of
    # DeepSpeed's runs inside the compiled forward (no effect without ZeRO-3)
    set_z3_leaf_modules(model, list({type(layer) for layer in layers}))
    for layer in layers:
        layer.forward = _side_effects_run_once(torch.compile(layer.forward, backend=backend))
        layer._hf_zero3_compiled = True
    return layers


def is_compiled(layer: torch.nn.Module) -> bool:
    """Whether `enable` compiled this layer's forward."""
    return getattr(layer, "_hf_zero3_compiled", False)
