"""The findings of a ds_config against the Trainer's arguments: precision (fp16, bf16 and its old alias), the
explicit values the HF bridge matches with TrainingArguments, and a DeepSpeed warmup scheduler with no warmup.
Each stops the run after the model has loaded, or trains otherwise than asked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

from hf_zero3.config.findings import Finding, lookup


def _enabled(config: dict, block: str) -> bool:
    return lookup(config, f"{block}.enabled") is True


def precision(config: dict, device: str | None, training_args: Mapping[str, Any] | None) -> list[Finding]:
    findings = []
    if training_args is not None:
        # What DeepSpeed will run with once the bridge has filled "auto" from TrainingArguments.
        on = {block: lookup(config, f"{block}.enabled") is True or (lookup(config, f"{block}.enabled") == "auto"
                                                                    and bool(training_args.get(block)))
              for block in ("fp16", "bf16")}
        if on["fp16"] and on["bf16"] and not (_enabled(config, "fp16") and _enabled(config, "bf16")):
            findings.append(Finding("error", "fp16.enabled",
                                    "fp16 and bf16 would both be on (the ds_config's and TrainingArguments' fp16/bf16 "
                                    "together): keep one, e.g. set both blocks' enabled to 'auto' and pass only "
                                    "--bf16 true (Ampere/Hopper) or only --fp16 true (V100/T4)"))
    if "bfloat16" in config:
        if "bf16" in config:
            findings.append(Finding("error", "bfloat16", "both 'bf16' and its old alias 'bfloat16' are set: DeepSpeed "
                                                         "reads only 'bf16'. Remove the 'bfloat16' block"))
        else:
            findings.append(Finding("warning", "bfloat16", "old alias of 'bf16': the HF Trainer adds "
                                                           "bf16.enabled=false when --bf16 is off, which DeepSpeed "
                                                           "reads first, so the run trains in fp32. Rename it 'bf16'"))
    if _enabled(config, "fp16") and (_enabled(config, "bf16") or _enabled(config, "bfloat16")):
        findings.append(Finding("error", "fp16.enabled", "fp16 and bf16 are both enabled: keep one "
                                                         "(bf16 on Ampere/Hopper, fp16 on V100/T4)"))
    if _enabled(config, "fp16"):
        if device == "cpu":
            findings.append(Finding("error", "fp16.enabled", "fp16 is not supported on CPU: set fp16.enabled "
                                                             "false (fp32) or use bf16"))
        findings.append(Finding("warning", "fp16.enabled",
                                "on Ampere/Hopper GPUs (A100, H100, H200) prefer bf16: same speed, no loss "
                                "scaling and no skipped overflow steps. Set bf16.enabled true and drop fp16 "
                                "(keep fp16 only for GPUs without bf16: V100, T4)"))
    return findings


BRIDGE_MATCHED = {
    "gradient_clipping": ("max_grad_norm", lambda a: a["max_grad_norm"]),
    "optimizer.params.lr": ("learning_rate", lambda a: a["learning_rate"]),
    "optimizer.params.betas": ("adam_beta1+adam_beta2", lambda a: [a["adam_beta1"], a["adam_beta2"]]),
    "optimizer.params.eps": ("adam_epsilon", lambda a: a["adam_epsilon"]),
    "optimizer.params.weight_decay": ("weight_decay", lambda a: a["weight_decay"]),
    "scheduler.params.warmup_max_lr": ("learning_rate", lambda a: a["learning_rate"]),
    "fp16.enabled": ("fp16", lambda a: bool(a["fp16"] or a["fp16_full_eval"])),
    "bf16.enabled": ("bf16", lambda a: bool(a["bf16"] or a["bf16_full_eval"])),
}
"""ds_config key -> the TrainingArguments value HfTrainerDeepSpeedConfig.trainer_config_process matches it with
(transformers 5.x; the batch keys are checked in `check._batch`)."""


def bridge_matches(config: dict, training_args: Mapping[str, Any]) -> list[Finding]:
    """An explicit value that differs from TrainingArguments: the bridge stops the run on it, after the model loaded."""
    findings = []
    for key, (name, value_of) in BRIDGE_MATCHED.items() if training_args else ():
        ours, theirs = lookup(config, key), value_of(training_args)
        if ours is not None and ours != "auto" and ours != theirs:
            findings.append(Finding("error", key, f"the config says {json.dumps(ours, default=str)} but TrainingArguments "
                                                  f"{name} is {json.dumps(theirs, default=str)}: set {key} to 'auto' (the Trainer fills "
                                                  f"it) or make them equal"))
    return findings


WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""DeepSpeed's schedulers that take `warmup_num_steps` (DeepSpeed 0.19.6 and later refuse it below 1; before, WarmupLR
and WarmupDecayLR raised it to 2)."""
DEEPSPEED_REFUSES_NO_WARMUP = (0, 19, 6)
TRANSFORMERS_FILLS_AT_LEAST_ONE = (5, 18)
"""From this transformers release the bridge fills `"auto"` warmup_num_steps with max(1, the run's warmup steps);
before it, with the warmup steps as they are (0 by default)."""


def _version(package: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version(package).split("+")[0].split(".")[:3] if part.isdigit())


def warmup(config: dict, training_args: Mapping[str, Any] | None) -> list[Finding]:
    """A DeepSpeed warmup scheduler with no warmup: DeepSpeed refuses it when the engine starts, after the model
    loaded (`warmup_num_steps must be a positive integer, got 0`), or the run warms up where none was asked."""
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict) or scheduler.get("type") not in WARMUP_SCHEDULERS:
        return []
    params = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
    value = params.get("warmup_num_steps", 1000)  # DeepSpeed's default
    if value == "auto" and training_args is not None:
        warmup = training_args.get("warmup_steps") or training_args.get("warmup_ratio") or 0
        return warmup_findings(scheduler["type"], "auto", float(warmup), _version("transformers"),
                               _version("deepspeed"))
    return warmup_findings(scheduler["type"], value, None, _version("transformers"), _version("deepspeed"))


def warmup_findings(kind: str, value: Any, warmup_steps: float | None, transformers: tuple[int, ...],
                    deepspeed: tuple[int, ...]) -> list[Finding]:
    """What DeepSpeed's `kind` scheduler does with `warmup_num_steps` `value` ("auto": filled from `warmup_steps`, the
    TrainingArguments'), under these transformers and DeepSpeed versions."""
    key = "scheduler.params.warmup_num_steps"
    fix = (f"set warmup_steps to 1 or more (the Trainer fills {key} from it), or remove the scheduler block: the "
           "Trainer's own schedule then applies (lr_scheduler_type, warmup_steps), where no warmup is allowed")
    if value == "auto":
        if warmup_steps is None or warmup_steps > 0:
            return []
        filled = 1 if transformers >= TRANSFORMERS_FILLS_AT_LEAST_ONE else 0
    elif isinstance(value, int) and not isinstance(value, bool) and value < 1:
        filled, fix = value, f"set {key} to 1 or more, or remove the scheduler block (the Trainer's schedule applies)"
    else:
        return []
    if filled < 1 and deepspeed >= DEEPSPEED_REFUSES_NO_WARMUP:
        source = "warmup_steps is 0 and this transformers fills it as is" if value == "auto" else "it is"
        return [Finding("error", key, f"{kind} needs at least 1 warmup step and DeepSpeed "
                                      f"{'.'.join(map(str, deepspeed))} stops the run on {filled} once the model has "
                                      f"loaded ({source}): {fix}")]
    given = "warmup_steps 0, which this transformers fills as 1" if value == "auto" and filled else f"{filled}"
    return [Finding("warning", key, f"{kind} warms up over at least 2 steps whatever it is given ({given}): the first "
                                    "step trains at the warmup's lowest learning rate. For no warmup remove the "
                                    "scheduler block (the Trainer's lr_scheduler_type and warmup_steps apply)")]
