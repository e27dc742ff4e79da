"""The facts of one run, worked out once from its arguments: everyone else asks here.

Why: micro batch x accumulation x world size was recomputed in ten places, precision (bf16/fp16/fp32) in three
and the attention clamp in two, each with its own defaults, and they drifted (one ignored fp16, one hard-coded
micro batch 8); the run's ZeroSpec was built three ways, and the OOM advice let a ds_config's cpu_checkpointing
override `activation_offload: false`, which the run honours. `RunFacts` is built from the parsed
TrainingArguments (the train entry, callbacks) or from the argument dict of a YAML + overrides (the launcher's dry
run, bench), with the dataclasses' own defaults; `RunFacts.spec` is the run's ZeroSpec for the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_zero3.config import batch
from hf_zero3.config.convert import asks_activation_offload, spec_from_ds_config
from hf_zero3.config.spec import ZeroSpec
from hf_zero3.data.arguments import DataArguments
from hf_zero3.plan.preference import preference_of
from hf_zero3.plan.types import ATTENTIONS, Preference


def planned_attention(name: str | None) -> str:
    """The planner's attention for a model's `attn_implementation`: anything it does not model (None, flex, a
    custom kernel) is planned as sdpa."""
    return name if name in ATTENTIONS else "sdpa"


def precision_of(bf16: Any, fp16: Any) -> str:
    """bf16, fp16 or fp32 from TrainingArguments' two switches (both on is refused before a run starts)."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def activation_offload_of(setting: bool | None, ds_config: dict | None) -> bool:
    """Whether the run keeps saved activations in host memory: `activation_offload` when it is set (false wins
    over the ds_config), else the ds_config's `activation_checkpointing.cpu_checkpointing`."""
    return setting if setting is not None else asks_activation_offload(ds_config)


@dataclass(frozen=True)
class RunFacts:
    """What a run is, independent of where it runs (the world size comes with the question)."""

    precision: str
    attention: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    from_scratch: bool
    activation_checkpointing: bool = False
    liger: bool = False
    activation_offload: bool | None = None
    """`activation_offload` as set: None leaves it to the ds_config (`activation_offload_of`)."""
    checkpointed_layers: int | None = None
    """`gradient_checkpointing_layers`: checkpointing on the first N layers only (None: all, when on)."""
    sequence_parallel: int = 1
    """`sequence_parallel_size`: ranks that share each sequence (Ulysses); the data-parallel size is world / this."""
    tiled_compute: bool = False
    """`tiled_compute`: the decoder MLPs in tiles along the sequence."""
    stage: str = "sft"
    """`stage`: sft, or the preference stage whose pairs and reference model the planner counts."""
    precompute_ref: bool = False
    """`stage_args.precompute_ref_log_probs`: the reference's log-probs computed before training (no second model)."""

    def preference(self, lora: bool) -> Preference | None:
        """What the stage adds to a step, as the planner counts it (None for SFT); `lora`: the run trains an
        adapter, so its reference is the base with the adapter off."""
        return preference_of(self.stage, lora=lora, precompute=self.precompute_ref)

    def checkpointing(self, activation_offload: bool) -> dict[str, Any]:
        """The spec fields for this run's checkpointing (`ZeroSpec`); with activation offload the planner models
        whole checkpointing only."""
        partial = self.checkpointed_layers if self.activation_checkpointing and not activation_offload else None
        return {"activation_checkpointing": self.activation_checkpointing, "checkpointed_layers": partial}

    def spec(self, ds_config: dict | None) -> ZeroSpec:
        """The run's ZeroSpec, as the planner models it: the ds_config's (ZeRO off without one) with this run's
        precision, checkpointing and activation offload, decided as the run decides them."""
        fields = spec_from_ds_config(ds_config)[0].model_dump(exclude_unset=True) if ds_config else {"stage": 0}
        offload = activation_offload_of(self.activation_offload, ds_config)
        return ZeroSpec(**{**fields, "precision": self.precision, **self.checkpointing(offload),
                           "activation_offload": offload})

    def global_batch(self, world_size: int) -> int:
        """Sequences per optimizer step over all ranks (ranks of one sequence-parallel group share a sequence)."""
        return batch.global_batch(self.micro_batch, self.grad_accum,
                                  batch.data_parallel(world_size, self.sequence_parallel))

    def describe(self, world_size: int) -> str:
        if self.sequence_parallel > 1:
            ranks = (f"{batch.data_parallel(world_size, self.sequence_parallel)} data-parallel ranks ({world_size} "
                     f"ranks / sequence parallel {self.sequence_parallel})")
        else:
            ranks = f"{world_size} ranks"
        return (f"micro batch {self.micro_batch} x accumulation {self.grad_accum} x {ranks} = global "
                f"batch {self.global_batch(world_size)}")

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> RunFacts:
        """From `load_arguments`' dict (YAML + overrides, coerced); what it leaves out takes the dataclass default."""
        # transformers' TrainingArguments takes seconds to import: the model card and the launcher ask facts without it
        from hf_zero3.job.arguments import TrainingArguments

        defaults = {f.name: f.default for cls in (DataArguments, TrainingArguments) for f in dataclasses.fields(cls)}

        def get(key: str) -> Any:
            return values.get(key, defaults.get(key))

        offload = get("activation_offload")
        stage_args = values.get("stage_args") or {}
        return cls(precision=precision_of(get("bf16"), get("fp16")),
                   attention=planned_attention(values.get("attn_implementation")),
                   micro_batch=int(get("per_device_train_batch_size")),
                   grad_accum=int(get("gradient_accumulation_steps")),
                   seq_len=int(get("block_size")),
                   from_scratch=not values.get("model_name_or_path"),
                   activation_checkpointing=bool(get("gradient_checkpointing")),
                   liger=bool(get("use_liger_kernel")), activation_offload=None if offload is None else bool(offload),
                   checkpointed_layers=get("gradient_checkpointing_layers"),
                   sequence_parallel=int(get("sequence_parallel_size")), tiled_compute=bool(get("tiled_compute")),
                   stage=get("stage") or "sft", precompute_ref=bool(stage_args.get("precompute_ref_log_probs")))

    @classmethod
    def from_args(cls, training_args: Any, seq_len: int, model_config: Any = None,
                  from_scratch: bool = False) -> RunFacts:
        """From parsed TrainingArguments (and the loaded model's config for the attention kernel it runs)."""
        offload = getattr(training_args, "activation_offload", None)
        stage_args = getattr(training_args, "stage_args", None) or {}
        return cls(precision=precision_of(training_args.bf16, training_args.fp16),
                   attention=planned_attention(getattr(model_config, "_attn_implementation", None)),
                   micro_batch=training_args.per_device_train_batch_size,
                   grad_accum=training_args.gradient_accumulation_steps,
                   seq_len=seq_len, from_scratch=from_scratch,
                   activation_checkpointing=bool(training_args.gradient_checkpointing),
                   liger=bool(getattr(training_args, "use_liger_kernel", False)),
                   activation_offload=None if offload is None else bool(offload),
                   checkpointed_layers=getattr(training_args, "gradient_checkpointing_layers", None),
                   sequence_parallel=getattr(training_args, "sequence_parallel_size", 1),
                   tiled_compute=bool(getattr(training_args, "tiled_compute", False)),
                   stage=getattr(training_args, "stage", None) or "sft",
                   precompute_ref=bool(stage_args.get("precompute_ref_log_probs")))


def global_batch_of(training_args: Any) -> int:
    """Sequences per optimizer step of a running Trainer, over its own world size (for callbacks)."""
    return batch.global_batch(training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps,
                              batch.data_parallel(training_args.world_size,
                                                  getattr(training_args, "sequence_parallel_size", 1)))


def ds_config_of(training_args: Any) -> dict | None:
    """The ds_config a running Trainer uses, as the HF bridge filled it; None without DeepSpeed."""
    bridge = getattr(training_args, "hf_deepspeed_config", None) if getattr(training_args, "deepspeed", None) else None
    return bridge.config if bridge is not None else None
