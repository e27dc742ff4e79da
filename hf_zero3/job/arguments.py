"""The run's arguments: the three dataclasses of one HfArgumentParser tuple, and the strict YAML + command-line
overrides they are parsed from.

Why their own module: the train entry, the launcher's dry run, bench and compare read a run's arguments, and the
run's facts (`job.facts`) take their defaults from these dataclasses; none of them needs the run itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers

from hf_zero3.data.arguments import DataArguments
from hf_zero3.parsing import ParseError, parse_value, parse_yaml
from hf_zero3.job.preemption import DEFAULT_SIGNALS, PREEMPTED_EXIT


class UsageError(ValueError):
    """Bad command-line or YAML input; the message names the fix."""


class ArgumentParser(transformers.HfArgumentParser):
    """HfArgumentParser whose ValueErrors (an unknown eval_strategy, TrainingArguments' own consistency checks such
    as fp16 with bf16) are usage errors: exit 2 with the message, not a traceback."""

    def parse_dict(self, *args, **kwargs):
        try:
            return super().parse_dict(*args, **kwargs)
        except ValueError as e:
            raise UsageError(f"bad arguments: {e}") from e


@dataclass
class ModelArguments:
    """Which model to train: pretrained weights (`model_name_or_path`) or a config to start from scratch."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local folder or hub id of pretrained weights (from_pretrained)."})
    config_name: str | None = field(
        default=None, metadata={"help": "Local folder or hub id of a config to train from scratch (from_config)."})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer folder or hub id; default: the model's or config's."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Comma-separated config changes, e.g. 'num_hidden_layers=2,hidden_size=64'."})
    dtype: str | None = field(
        default=None, metadata={"help": "dtype to load weights in (bfloat16, float16, float32); default: the config's."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel: sdpa, eager, flash_attention_2."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the hub."})
    peft: dict | None = field(
        default=None, metadata={"help": "LoRA on the frozen base: peft's LoraConfig fields {r, lora_alpha, lora_dropout, "
                                        "target_modules (a list, or all-linear), ...}. See docs/lora.md."})
    leaf_modules: list[str] | None = field(
        default=None, metadata={"help": "Module classes ZeRO-3 gathers whole, e.g. a mixture of experts' block (its "
                                        "router and experts). Default: found from the model's experts "
                                        "(hf_zero3/plan/experts.py); [] for none. A ds_config with its own "
                                        "zero_optimization.leaf_module wins. See docs/experts.md."})
    ref_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Preference stages: the reference model (default: the policy's own starting "
                                        "weights). See docs/preference.md."})


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """The stock TrainingArguments plus what transformers 5 dropped and we need."""

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Train into an output_dir that already holds a run (its files are "
                                          "overwritten). Without it such a dir is refused."})
    save_final_model: bool = field(
        default=True, metadata={"help": "Save the final model to output_dir after training. `hf-zero3 bench` turns "
                                        "it off: its scratch runs measure steps, and an 8B save takes tens of seconds."})
    stop_after_nonfinite_steps: int = field(
        default=3, metadata={"help": "Stop training, naming the newest complete checkpoint, after this many optimizer "
                                     "steps in a row with a NaN/inf loss or gradients (0: never stop; saves are "
                                     "skipped on such steps either way)."})
    activation_offload: bool | None = field(
        default=None, metadata={"help": "Keep the activations the decoder saves for backward in pinned host memory, "
                                         "copied back ahead of use on side CUDA streams (with gradient_checkpointing: "
                                         "the checkpointed layer inputs). Also on when the ds_config says "
                                         "activation_checkpointing.cpu_checkpointing: true, unless this says false. "
                                         "See hf_zero3/model/activation_offload.py."})
    gradient_checkpointing_layers: int | None = field(
        default=None, metadata={"help": "With gradient_checkpointing: checkpoint only the first N decoder layers; the "
                                         "others keep their activations and skip their recompute (more memory, "
                                         "faster). Default: all layers. See "
                                         "hf_zero3/callbacks/partial_checkpointing.py."})
    regional_compile: bool = field(
        default=False, metadata={"help": "torch.compile each decoder layer in place (not the whole model, as "
                                         "torch_compile does): the loss, Liger's fused cross-entropy included, stays "
                                         "outside the compiler; works with ZeRO-3 and checkpointing. See "
                                         "hf_zero3/model/regional_compile.py."})
    regional_compile_backend: str = field(
        default="inductor", metadata={"help": "torch.compile backend of regional_compile: inductor, or aot_eager / "
                                              "eager (tracing only, no code generation)."})
    fp8: bool = field(
        default=False, metadata={"help": "FP8 matmuls in the decoder layers' linears (torchao float8 training; the "
                                         "weights, gradients and optimizer keep their dtypes). Needs "
                                         "regional_compile and torchao; on a GPU, FP8 tensor cores (compute "
                                         "capability 8.9+); emulated on CPU. See hf_zero3/model/fp8.py."})
    fp8_recipe: str = field(
        default="tensorwise", metadata={"help": "torchao's float8 scaling with fp8: tensorwise (fastest), rowwise, "
                                                "rowwise_with_gw_hp (most accurate)."})
    peak_tflops: float | None = field(
        default=None, metadata={"help": "Dense bf16 TFLOP/s of one GPU, for MFU (default: looked up by GPU name; see "
                                        "hf_zero3/callbacks/throughput.py PEAK_TFLOPS)."})
    preemption_signals: str = field(
        default=DEFAULT_SIGNALS, metadata={"help": "Comma-separated signals a scheduler sends before it kills the job "
                                                   "(SLURM --signal, spot VMs): on one, every rank finishes its step, "
                                                   "a checkpoint is saved and the run exits with code "
                                                   f"{PREEMPTED_EXIT}; none: off. See hf_zero3/job/preemption.py."})
    sequence_parallel_size: int = field(
        default=1, metadata={"help": "Ulysses sequence parallelism: each sequence split over this many ranks "
                                     "(DeepSpeed's, through the stock ParallelismConfig); the data-parallel size is "
                                     "world size / this. Needs a ds_config. See docs/long-sequences.md."})
    tiled_compute: bool = field(
        default=False, metadata={"help": "Long sequences: the decoder MLPs computed in tiles along the sequence "
                                         "(DeepSpeed's sequence_tiled_compute), the full intermediate activation "
                                         "never held at once; the logits+loss are TRL's fused LM head's tiles "
                                         "already. See docs/long-sequences.md."})
    tiled_compute_tokens: int | None = field(
        default=None, metadata={"help": "With tiled_compute: tokens per MLP tile. Default: the hidden size."})
    hub_license: str | None = field(
        default=None, metadata={"help": "License in the model card of exports and Hub pushes, e.g. apache-2.0 or "
                                        "llama3.1 (the base model's); default: other."})
    stage: str = field(
        default="sft", metadata={"help": "Training method: sft, dpo, orpo, simpo or kto, on TRL's trainer for it "
                                         "(hf_zero3/run/stages.py). See docs/preference.md."})
    stage_args: dict | None = field(
        default=None, metadata={"help": "TRL's own arguments of the stage's config by TRL's names, e.g. {beta: 0.1, "
                                        "loss_type: sigmoid} for dpo; unknown keys are refused."})


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _type_words(annotation: Any) -> set[str]:
    """The type names in a field annotation, e.g. {'dict', 'str', 'None'} for `dict | str | None`."""
    return set(re.findall(r"[A-Za-z]+", annotation if isinstance(annotation, str) else str(annotation)))


class _Words(list):
    """The values after one `--key` on a command line (`--leaf_modules A B`): a list only for a field that takes one."""


def _options(annotation: Any) -> tuple:
    return typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)


def _takes_list(annotation: Any) -> bool:
    return any(typing.get_origin(o) is list for o in _options(annotation))


def _list_only(annotation: Any) -> bool:
    """A field that takes a list and no single text (`list[str] | None`, not `str | list[str]`)."""
    return _takes_list(annotation) and str not in _options(annotation)


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Give a YAML or command-line value its field's type.

    Command-line values arrive as text; PyYAML reads `2e-5` as a string and `no` as False (YAML 1.1),
    which breaks `eval_strategy: no`. `null` means None for optional fields. A list field takes one name as a list
    of one (`--leaf_modules A`), several words as a list (`--leaf_modules A B`) or a YAML list (`'[A, B]'`).
    """
    words = _type_words(annotation)
    if isinstance(value, _Words):
        if not _takes_list(annotation):
            raise ValueError(f"{name} takes one value, not {len(value)} ({' '.join(value)}): quote a value that "
                             "holds spaces")
        return list(value)
    if isinstance(value, bool) and "bool" not in words and any(w.endswith("Strategy") for w in words):
        return "yes" if value else "no"  # eval_strategy: no
    if not isinstance(value, str):
        return value
    low = value.strip().lower()
    if low in ("null", "~") and words & {"None", "NoneType", "Optional"}:
        return None
    if "bool" in words and "str" not in words:
        if low in _TRUE + _FALSE:
            return low in _TRUE
        raise ValueError(f"{name} takes true or false, not {value!r}")
    if "bool" in words and low in ("true", "false"):  # str | bool fields (include_num_input_tokens_seen)
        return low == "true"
    if "str" not in words:
        number = float if "float" in words else int if "int" in words else None
        if number is not None:
            try:
                return number(value)
            except ValueError:
                raise ValueError(f"{name} takes a number, not {value!r}") from None
    if _list_only(annotation) and not low.startswith(("[", "{")):
        return [value]
    if words & {"dict", "list"} and low.startswith(("{", "[")):
        return parse_value(value, f"--{name}", "Write the value whole, in quotes, every { and [ closed, e.g. "
                           "--peft '{r: 8, lora_alpha: 16}'")
    return value


def _parse_overrides(argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, `--key v1 v2` (a list field's values) and bare `--flag` (= true), values kept
    as text for `_coerce`."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}: overrides are --key value pairs")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            end = next((j for j in range(i + 1, len(argv)) if argv[j].startswith("--")), len(argv))
            text = argv[i + 1] if end == i + 2 else _Words(argv[i + 1:end])
            i = end
        else:
            text = "true"
            i += 1
        overrides[key.replace("-", "_")] = text  # --max-steps is --max_steps; values keep their dashes
    return overrides


def _strip_local_rank(argv: list[str]) -> list[str]:
    """The DeepSpeed launcher prepends --local_rank=N; the same number is in $LOCAL_RANK."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank"):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            skip = True
        else:
            kept.append(arg)
    return kept


def load_arguments(argv: list[str]) -> dict[str, Any]:
    """YAML file (first argument, optional) with CLI overrides on top, as one dict; unknown keys rejected."""
    values: dict[str, Any] = {}
    argv = _strip_local_rank(argv)
    if argv and not argv[0].startswith("--"):
        path = Path(argv[0])
        if not path.is_file():
            raise UsageError(f"config file {path} not found: pass a YAML of training arguments (see recipes/*/)")
        try:
            loaded = parse_yaml(path.read_text(), str(path), "Fix the YAML there (one `name: value` per line, "
                                "spaces not tabs)") or {}
        except OSError as e:
            raise UsageError(f"config file {path} cannot be read ({e.strerror}): fix its permissions") from e
        except UnicodeDecodeError as e:
            raise UsageError(f"config file {path} is not text (byte {e.start} is not UTF-8): pass a YAML file") from e
        except ParseError as e:
            raise UsageError(str(e)) from None
        if not isinstance(loaded, dict):
            raise UsageError(f"{path} must be a YAML mapping of argument: value")
        values.update(loaded)
        deepspeed = values.get("deepspeed")
        if isinstance(deepspeed, str) and not os.path.isabs(deepspeed) and (path.parent / deepspeed).is_file():
            values["deepspeed"] = str(path.parent / deepspeed)  # a copied recipe folder keeps its own config
        argv = argv[1:]
    values.update(_parse_overrides(argv))
    # Types from the annotations: HfArgumentParser rewrites dataclass fields' `.type` (dict | str | None -> str).
    known = {f.name: typing.get_type_hints(cls)[f.name] for cls in (ModelArguments, DataArguments, TrainingArguments)
             for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in values if k not in known]
    if unknown:
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, known, n=1)) else k
                 for k in unknown]
        raise UsageError(f"unknown argument(s): {', '.join(hints)}. Fix the spelling or remove them; "
                         "`hf-zero3 train --help` lists the arguments")
    try:
        return {k: _coerce(v, known[k], k) for k, v in values.items()}
    except ValueError as e:
        raise UsageError(f"bad value: {e}") from e
