"""What a preference stage (DPO, ORPO/SimPO, KTO) adds to the plan of a step.

Chosen and rejected go through one forward, concatenated: twice the sequences per pair, so twice the activations
and both answers' logits (`Training.tokens` counts them). The reference model, when it is a second model, is a
forward-only DeepSpeed engine partitioned like the policy under ZeRO-3 (TRL's `prepare_deepspeed`: under ZeRO-1/2 it
runs at stage 0, a whole 16-bit copy on every GPU), with no gradients, master weights or optimizer states; its
gathers are transient like the policy's. With LoRA (the adapter disabled) or precomputed log-probs it costs nothing
during training; the precompute is one forward pass before it.
"""

from __future__ import annotations

import math

from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.types import Hardware, Preference, Term, Training

PAIRED_STAGES = ("dpo", "orpo", "simpo")
"""Stages whose examples are pairs (chosen and rejected in one forward); KTO's are single completions."""
REFERENCE_STAGES = ("dpo", "kto")


def preference_of(stage: str, *, lora: bool = False, precompute: bool = False) -> Preference | None:
    """The planner's view of a stage; None for SFT."""
    if stage == "sft":
        return None
    keeps = stage in REFERENCE_STAGES and not lora and not precompute
    return Preference(stage, 2 if stage in PAIRED_STAGES else 1, "engine" if keeps else "none")


def reference_terms(shape: ModelShape, hardware: Hardware, training: Training, spec: ZeroSpec,
                    element_bytes: int) -> list[Term]:
    """The reference engine's 16-bit weights on each GPU; nothing when there is no second model."""
    if training.preference is None or training.preference.reference != "engine":
        return []
    W, P = hardware.world_size, shape.params
    if spec.stage == 3:
        held, formula = math.ceil(P / W), f"{element_bytes} B x {P:,} / {W} GPUs (ZeRO-3 partition, forward only)"
    else:
        held, formula = P, f"{element_bytes} B x {P:,} (stage 0 under ZeRO-{spec.stage}: whole on every GPU)"
    return [Term(f"reference model, {8 * element_bytes}-bit ({training.preference.stage})", "gpu",
                 element_bytes * held, formula)]


def notes(training: Training) -> list[str]:
    """What the plan says about the stage."""
    pref = training.preference
    if pref is None:
        return []
    pairs = (f"{pref.stage}: chosen and rejected in one forward, {pref.sequences} sequences per example (activations "
             "and logits of both)") if pref.sequences > 1 else f"{pref.stage}: one sequence per example"
    ref = ("a second model as reference, partitioned like the policy" if pref.reference == "engine" else
           "no second model (reference-free, LoRA's adapter disabled, or log-probs precomputed)")
    return [f"{pairs}; {ref}"]
