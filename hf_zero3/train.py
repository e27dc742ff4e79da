"""`hf-zero3 train CONFIG.yaml [--key value ...]` (also `python -m hf_zero3.train`): the stock Trainer, set up right.

One HfArgumentParser over (ModelArguments, DataArguments, TrainingArguments); strict YAML; CLI overrides
on top. TrainingArguments (and with it the DeepSpeed config) exist before the model, so ZeRO-3 partitions
the weights while they load. No training loop of our own: `transformers.Trainer` plus our callbacks.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers
import yaml

from hf_zero3.data import DataArguments, DataError
from hf_zero3.distributed import LaunchError, cuda_available, is_world_process_zero, prepare_process_group


class UsageError(ValueError):
    """Bad command-line or YAML input; the message names the fix."""


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


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """The stock TrainingArguments plus what transformers 5 dropped and we need."""

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Train into an output_dir that already holds a run (its files are "
                                          "overwritten). Without it such a dir is refused."})
    save_final_model: bool = field(
        default=True, metadata={"help": "Save the final model to output_dir after training. `hf-zero3 bench` turns "
                                        "it off: its scratch runs measure steps, and an 8B save takes tens of seconds."})


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _type_words(annotation: Any) -> set[str]:
    """The type names in a field annotation, e.g. {'dict', 'str', 'None'} for `dict | str | None`."""
    return set(re.findall(r"[A-Za-z]+", annotation if isinstance(annotation, str) else str(annotation)))


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Give a YAML or command-line value its field's type.

    Command-line values arrive as text; PyYAML reads `2e-5` as a string and `no` as False (YAML 1.1),
    which breaks `eval_strategy: no`. `null` means None for optional fields.
    """
    words = _type_words(annotation)
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
    if words & {"dict", "list"} and low.startswith(("{", "[")):
        try:
            return json.loads(value)  # JSON reads 1e-5 as a number; YAML 1.1 would keep it a string
        except json.JSONDecodeError:
            return yaml.safe_load(value)
    return value


def _parse_overrides(argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value` and bare `--flag` (= true), values kept as text for `_coerce`."""
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
            text = argv[i + 1]
            i += 2
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
        loaded = yaml.safe_load(path.read_text()) or {}
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


def _check_output_dir(output_dir: str, resume: str | None, overwrite: bool) -> str | None:
    """Refuse to train over an earlier run unless asked; resolve `resume_from_checkpoint: auto` to the newest
    *complete* checkpoint and remove half-written ones newer than the resume point (hf_zero3.checkpoint)."""
    import torch.distributed as dist

    from hf_zero3.checkpoint import CheckpointError, plan_resume, remove_checkpoint

    path = Path(output_dir)
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise UsageError(f"resume_from_checkpoint {resume} is not a directory: pass a checkpoint-N folder "
                         "or 'auto' for the newest complete one in output_dir")
    if resume is not None:
        try:
            target, half_written = plan_resume(output_dir, resume, int(os.environ.get("WORLD_SIZE", "1")))
        except CheckpointError as e:
            raise UsageError(str(e)) from e
        if dist.is_initialized():
            dist.barrier()  # every rank has decided before rank 0 deletes anything
        for folder in half_written if is_world_process_zero() else []:
            print(f"hf_zero3: removing {folder}: its save never finished (no completion marker)", flush=True)
            remove_checkpoint(folder)
        if dist.is_initialized():
            dist.barrier()  # deletions done before any rank looks at the folder again
        if target is not None:
            return str(target)
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        if resume == "auto":
            raise UsageError(f"output_dir {output_dir} holds files but no complete checkpoint to resume: pass "
                             "--overwrite_output_dir true to train over it, or choose another output_dir")
        raise UsageError(f"output_dir {output_dir} already holds a run: pass --resume_from_checkpoint auto to "
                         "continue it, --overwrite_output_dir true to train over it, or choose another output_dir")
    old_checkpoints = sorted(p.name for p in path.glob("checkpoint-*") if p.is_dir() and any(p.iterdir())) \
        if path.is_dir() else []
    if overwrite and old_checkpoints:
        # Keep-last-N ranks checkpoints by step: an old checkpoint-1000 would outrank (and so delete) this run's
        # checkpoint-200, and `resume auto` would later pick the old run. Nothing is deleted on the user's behalf.
        raise UsageError(f"output_dir {output_dir} holds checkpoints of an earlier run ({', '.join(old_checkpoints[:3])}"
                         f"{', ...' if len(old_checkpoints) > 3 else ''}): --overwrite_output_dir overwrites files but "
                         "does not mix checkpoints of two runs. Move or delete them, or choose another output_dir")
    return None


def _load_model_and_tokenizer(model_args: ModelArguments):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = model_args.model_name_or_path or model_args.config_name
    if source is None:
        raise UsageError("no model given: set model_name_or_path (pretrained weights) or config_name "
                         "(train from scratch)")
    for name, value in (("model_name_or_path", model_args.model_name_or_path),
                        ("config_name", model_args.config_name), ("tokenizer_name", model_args.tokenizer_name)):
        if value and not os.path.isdir(value) and (value.startswith((".", "/", "~")) or value.count("/") > 1):
            raise UsageError(f"{name} {value} does not exist: point it at a model folder (config.json inside) "
                             "or a hub id like org/name")
    common = {"trust_remote_code": model_args.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(source, **common)
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or source, **common)
    except OSError as e:
        raise UsageError(f"could not load {source}: {e}. Use a local folder, or a hub id with network access "
                         "(or a filled HF cache)") from e
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    if len(tokenizer) > config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{config.vocab_size}: use the model's own tokenizer (tokenizer_name) or raise vocab_size "
                         "(config_overrides: vocab_size=N when training from scratch)")
    config.use_cache = False  # the KV cache is for generation; training only pays for it
    kwargs = {**common}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.model_name_or_path:
        if model_args.dtype:
            kwargs["dtype"] = model_args.dtype
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model, tokenizer


def _banner(trainer) -> str:
    args = trainer.args
    ds = args.hf_deepspeed_config.config if args.deepspeed else None
    stage = ds.get("zero_optimization", {}).get("stage", 0) if ds else "off (no deepspeed config)"
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    return (f"hf_zero3: ZeRO stage {stage} | world size {args.world_size} | micro batch "
            f"{args.per_device_train_batch_size} x accumulation {args.gradient_accumulation_steps} x "
            f"{args.world_size} ranks = global batch {global_batch} | {precision} | device {args.device}")


def _explain_oom(error: BaseException, model_config, training_args, seq_len: int) -> None:
    """On an out-of-memory error, print the planner's next step as exact overrides (then the error is re-raised)."""
    from hf_zero3.planner import oom_advice_for_run, oom_kind

    kind = oom_kind(error)
    if kind is None:
        return
    try:
        advice = oom_advice_for_run(model_config, training_args, seq_len, host=kind == "host")
    except Exception as planner_error:  # noqa: BLE001 -- never hide the OOM behind a planner problem
        advice = f"(the planner could not suggest a next step: {planner_error})"
    print(f"[rank {os.environ.get('RANK', '0')}] hf_zero3: out of {'host' if kind == 'host' else 'GPU'} memory. "
          f"{advice}", file=sys.stderr, flush=True)


def write_run_config(path: Path, model_args, data_args, trainer, by_callbacks: dict[str, Any]) -> None:
    """The resolved arguments and the ds_config as the bridge filled it: what actually ran.

    `by_callbacks` holds the user's settings that our callbacks carry out while the Trainer's own copy is off
    (save_total_limit, push_to_hub): recorded as the user set them, so a rerun from this file does the same.
    """
    ds = trainer.args.hf_deepspeed_config.config if trainer.args.deepspeed else None
    resolved = {"model": dataclasses.asdict(model_args), "data": dataclasses.asdict(data_args),
                "training": {**trainer.args.to_dict(), **by_callbacks}, "ds_config": ds,
                "world_size": trainer.args.world_size}
    path.write_text(json.dumps(resolved, indent=2, default=str) + "\n")


def run(argv: list[str], extra_callbacks: Sequence[Any] = ()) -> dict[str, float]:
    """Parse, set up, train, save; returns the final metrics. `extra_callbacks` go after ours (e.g. a probe)."""
    from transformers import HfArgumentParser, Trainer, default_data_collator, set_seed

    from hf_zero3.callbacks import (
        DeepSpeedTimersCallback,
        HubPushCallback,
        default_callbacks,
        install_callbacks,
    )
    from hf_zero3.checkpoint import CheckpointError, list_checkpoints
    from hf_zero3.data import build_datasets

    values = load_arguments(argv)
    on_cpu = bool(values.get("use_cpu")) or not cuda_available()
    if on_cpu:
        if values.get("fp16"):
            raise UsageError("fp16 is not supported on CPU: drop --fp16 (fp32) or use --bf16 true")
        values["use_cpu"] = True
        if values.get("use_liger_kernel"):  # Liger's kernels are Triton GPU kernels; the same recipe runs on CPU
            print("hf_zero3: use_liger_kernel needs a GPU: off on CPU", flush=True)
            values["use_liger_kernel"] = False
    prepare_process_group(on_cpu=on_cpu, use_deepspeed=bool(values.get("deepspeed")))
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_dict(values, allow_extra_keys=False)
    resume = _check_output_dir(training_args.output_dir, training_args.resume_from_checkpoint,
                               training_args.overwrite_output_dir)

    set_seed(training_args.seed)  # before the model: every rank (and every run) starts from the same weights
    model, tokenizer = _load_model_and_tokenizer(model_args)
    train_dataset, eval_dataset = build_datasets(data_args, tokenizer, training_args,
                                                 max_positions=model.config.max_position_embeddings)
    try:
        callbacks = [*default_callbacks(training_args, seq_len=data_args.block_size), *extra_callbacks]
    except CheckpointError as e:  # e.g. push_to_hub without a usable hub_model_id
        raise UsageError(str(e)) from e
    # CheckpointGuardCallback rotates over complete checkpoints and HubPushCallback uploads exported weights (both
    # took these settings above): the Trainer's own rotation and push (which would create the Hub repo in its
    # __init__ and upload whatever save_model wrote), blind to incomplete saves, stay off.
    by_callbacks = {"save_total_limit": training_args.save_total_limit, "push_to_hub": training_args.push_to_hub}
    training_args.save_total_limit, training_args.push_to_hub = None, False
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    install_callbacks(trainer, [DeepSpeedTimersCallback(trainer), *callbacks])
    if trainer.is_world_process_zero():
        print(_banner(trainer), flush=True)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        _explain_oom(error, model.config, training_args, data_args.block_size)
        raise
    metrics = dict(result.metrics)
    if training_args.save_final_model:
        trainer.save_model()
    trainer.save_state()
    if eval_dataset is not None:
        eval_metrics = trainer.evaluate()
        eval_metrics["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    for callback in trainer.callback_handler.callbacks:  # pushes run in a thread on rank 0; collectives are done
        if isinstance(callback, HubPushCallback):
            callback.wait()
    if trainer.is_world_process_zero():
        out = Path(training_args.output_dir)
        write_run_config(out / "run_config.json", model_args, data_args, trainer, by_callbacks)
        checkpoints = list_checkpoints(out)
        if training_args.save_final_model:
            print(f"hf_zero3: final model: {out}", flush=True)
        if checkpoints:
            print(f"hf_zero3: last checkpoint: {checkpoints[-1]}", flush=True)
        print(f"hf_zero3: logs: {out / 'train_log.jsonl'} (and trainer_state.json)", flush=True)
        print("hf_zero3: metrics: " + json.dumps({k: round(v, 4) for k, v in metrics.items()
                                                   if isinstance(v, float)}), flush=True)
    return metrics


def main(argv: list[str] | None = None, extra_callbacks: Sequence[Any] = ()) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from transformers import HfArgumentParser

        print("usage: hf-zero3 train [CONFIG.yaml] [--key value ...]\n")
        HfArgumentParser((ModelArguments, DataArguments, TrainingArguments)).print_help()
        return 0
    try:
        run(argv, extra_callbacks)
    except (UsageError, DataError, LaunchError) as e:
        if is_world_process_zero():
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
