"""`hf-zero3 train CONFIG.yaml [--key value ...]` (also `python -m hf_zero3.train`): the stock Trainer, set up right.

One HfArgumentParser over (ModelArguments, DataArguments, TrainingArguments); strict YAML; CLI overrides
on top. TrainingArguments (and with it the DeepSpeed config) exist before the model, so ZeRO-3 partitions
the weights while they load. No training loop of our own: `transformers.Trainer` plus our callbacks.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import shutil
import sys
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers
import yaml

from hf_zero3.data.arguments import DataArguments, block_size_problem
from hf_zero3.data.errors import DataError
from hf_zero3.run import lora
from hf_zero3.run.distributed import (
    LaunchError,
    cuda_available,
    is_world_process_zero,
    launched_world_size,
    prepare_process_group,
    process_group_released,
    release_engine,
)
from hf_zero3.run.facts import RunFacts
from hf_zero3.run.preemption import DEFAULT_SIGNALS, PREEMPTED_EXIT, parse_signals


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
        default=None, metadata={"help": "LoRA on the frozen base: {r, alpha, dropout, target_modules (a list, or "
                                        "all-linear)}. See docs/lora.md."})


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
                                         "See hf_zero3/run/activation_offload.py."})
    gradient_checkpointing_layers: int | None = field(
        default=None, metadata={"help": "With gradient_checkpointing: checkpoint only the first N decoder layers; the "
                                         "others keep their activations and skip their recompute (more memory, "
                                         "faster). Default: all layers. See "
                                         "hf_zero3/callbacks/partial_checkpointing.py."})
    peak_tflops: float | None = field(
        default=None, metadata={"help": "Dense bf16 TFLOP/s of one GPU, for MFU (default: looked up by GPU name; see "
                                        "hf_zero3/callbacks/throughput.py PEAK_TFLOPS)."})
    preemption_signals: str = field(
        default=DEFAULT_SIGNALS, metadata={"help": "Comma-separated signals a scheduler sends before it kills the job "
                                                   "(SLURM --signal, spot VMs): on one, every rank finishes its step, "
                                                   "a checkpoint is saved and the run exits with code "
                                                   f"{PREEMPTED_EXIT}; none: off. See hf_zero3/run/preemption.py."})
    hub_license: str | None = field(
        default=None, metadata={"help": "License in the model card of exports and Hub pushes, e.g. apache-2.0 or "
                                        "llama3.1 (the base model's); default: other."})


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
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise UsageError(f"config file {path} cannot be read ({e.strerror}): fix its permissions") from e
        except UnicodeDecodeError as e:
            raise UsageError(f"config file {path} is not text (byte {e.start} is not UTF-8): pass a YAML file") from e
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            raise UsageError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}. Fix the YAML there "
                             "(one `name: value` per line, spaces not tabs)") from e
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


FINISHED = "finished"
"""`_start_point`'s answer when output_dir already holds this run, finished: nothing to train."""

_CHECKPOINT_INTERNALS = ("rng_state", "optimizer.pt", "scheduler.pt", "scaler.pt", "latest", "zero_to_",
                         "hf_zero3_")
"""Top-level checkpoint files that belong to resuming, not to the final model folder."""


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _verify_on_all_ranks(folder: Path) -> list[str]:
    """Checksums of a marked checkpoint, each rank its share (all ranks call this in the same order)."""
    import torch.distributed as dist

    from hf_zero3.callbacks._gather import gather_from_ranks
    from hf_zero3.checkpoint.lifecycle import verify_complete

    on = dist.is_available() and dist.is_initialized()
    mine = verify_complete(folder, dist.get_rank() if on else 0, dist.get_world_size() if on else 1)
    return [p for record in gather_from_ranks({"problems": mine}) for p in record["problems"]]


def _is_finished(record: dict | None, args) -> bool:
    """Whether a finished record answers this command: same or lower max_steps, or the same epochs."""
    if record is None:
        return False
    if args.max_steps > 0:
        return record.get("global_step", -1) >= args.max_steps
    return record.get("max_steps", 0) <= 0 and record.get("num_train_epochs") == args.num_train_epochs


def _finish_from(checkpoint: Path, output_dir: Path, args) -> None:
    """The checkpoint is at (or past) max_steps but the run died before its final save: the final model is the
    checkpoint's (the Trainer saved it with the same `save_model`); copy it, then mark the run finished.
    Resuming instead would train one step past max_steps. A copy, not a hard link: the Trainer rewrites
    output_dir's files in place (trainer_state.json, the weights) when training goes on, and a link would change
    the checkpoint with them."""
    from hf_zero3.checkpoint.lifecycle import ADAPTER_WEIGHTS, resume_step, rotate, write_finished

    if is_world_process_zero():
        for path in sorted(checkpoint.iterdir()):
            if path.is_file() and not path.name.startswith(_CHECKPOINT_INTERNALS):
                target = output_dir / path.name
                tmp = output_dir / f".{path.name}.tmp"
                tmp.unlink(missing_ok=True)
                shutil.copy2(path, tmp)
                os.replace(tmp, target)
        if not any(output_dir.glob("model*.safetensors")) and not (output_dir / ADAPTER_WEIGHTS).is_file():
            print(f"hf_zero3: {checkpoint} holds no 16-bit weights (gathering is off): `hf-zero3 export {checkpoint} "
                  "<folder>` writes the final model", flush=True)
        for old in rotate(output_dir, args.save_total_limit):  # the killed run may not have rotated yet
            print(f"hf_zero3: deleted {old} (keeping the newest {args.save_total_limit} complete)", flush=True)
        write_finished(output_dir, {"global_step": resume_step(checkpoint), "max_steps": args.max_steps,
                                    "num_train_epochs": args.num_train_epochs, "from_checkpoint": str(checkpoint)})
    _barrier()


def _start_point(args) -> str | None:
    """Where this run starts: None (from scratch), a checkpoint path, or FINISHED (nothing to do).

    Refuses to train over an earlier run unless asked. `resume_from_checkpoint: auto` is one command that always
    does the right thing, for retry loops and requeues: start when nothing is there, resume from the newest
    checkpoint that verifies, and say "already finished" when the run is done. Only our own unfinished saves are
    deleted; everything else is left in place and named (hf_zero3.checkpoint.lifecycle, docs/checkpoints.md).
    """
    from hf_zero3.checkpoint import lifecycle as ckpt

    output_dir, resume = Path(args.output_dir), args.resume_from_checkpoint
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"output_dir {output_dir} is a file, not a folder: choose another output_dir")
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise UsageError(f"resume_from_checkpoint {resume} is not a directory: pass a checkpoint-N folder "
                         "or 'auto' for the newest complete one in output_dir")
    if is_world_process_zero():
        for left in ckpt.finish_deletions(output_dir):
            print(f"hf_zero3: finished deleting {left} (a rotation that was interrupted)", flush=True)
    if resume == "auto" and _is_finished(ckpt.read_finished(output_dir), args):
        if is_world_process_zero():
            record = ckpt.read_finished(output_dir)
            print(f"hf_zero3: {output_dir} already finished at step {record.get('global_step')} (final model there): "
                  "nothing to do. Raise --max_steps (or num_train_epochs) to train further", flush=True)
        return FINISHED
    if resume is not None:
        try:
            plan = ckpt.plan_resume(output_dir, resume, int(os.environ.get("WORLD_SIZE", "1")),
                                    verify=_verify_on_all_ranks)
        except ckpt.CheckpointError as e:
            raise UsageError(str(e)) from e
        if resume == "auto" and plan.target is None and plan.skipped:
            raise UsageError(f"nothing to resume in {output_dir}, and it holds checkpoint folders that are not "
                             f"complete: {ckpt.describe_found(plan.skipped)}. Nothing was deleted. Move them out of "
                             "output_dir (or choose another output_dir) to start over")
        for found in plan.skipped if is_world_process_zero() else []:
            print(f"hf_zero3: not resuming from {found.path}: {found.why}. It stays where it is (move it aside if "
                  f"you do not need it); resuming from {plan.target}", flush=True)
        target = plan.target
        if target is not None and args.max_steps > 0 and ckpt.resume_step(target) is not None \
                and ckpt.resume_step(target) >= args.max_steps:
            _finish_from(target, output_dir, args)
            if is_world_process_zero():
                print(f"hf_zero3: {target} is at step {ckpt.resume_step(target)} >= max_steps {args.max_steps}: "
                      f"the run is finished; its final model is in {output_dir}", flush=True)
            return FINISHED
        _barrier()  # every rank has decided before rank 0 deletes anything
        for folder in plan.delete if is_world_process_zero() else []:
            print(f"hf_zero3: removing {folder}: its save never finished (no completion marker)", flush=True)
            ckpt.remove_checkpoint(folder)
        _barrier()  # deletions done before any rank looks at the folder again
        start = ckpt.resume_step(target) if target is not None else 0
        if args.max_steps > 0 and args.save_strategy in ("steps", "best"):
            every = int(args.save_steps) if args.save_strategy == "steps" and args.save_steps >= 1 else None
            if collisions := ckpt.save_collisions(output_dir, start or 0, args.max_steps, every):
                raise UsageError(f"this run would save into {', '.join(str(f.path) for f in collisions)}, which "
                                 f"{'is' if len(collisions) == 1 else 'are'} not this run's to overwrite "
                                 f"({ckpt.describe_found(collisions)}). Nothing was deleted. Move "
                                 f"{'it' if len(collisions) == 1 else 'them'} out of output_dir, then run the same "
                                 "command again")
        if target is not None:
            for found in plan.failed if is_world_process_zero() else []:  # the run goes on: keep-last-N must
                ckpt.mark_failed(found.path, found.why)                   # never count it again
            return str(target)
    if output_dir.is_dir() and any(p.name != ckpt.RUN_ID for p in output_dir.iterdir()) \
            and not args.overwrite_output_dir:  # only a claim: a run that stopped before training (bad input)
        if resume == "auto" and (record := ckpt.read_finished(output_dir)) is not None:
            raise UsageError(f"{output_dir} holds a finished run (step {record.get('global_step')}, its final model) "
                             "and no complete checkpoint to continue from, so training further would start from "
                             "scratch and overwrite that model. Nothing was changed. To train on from it, start a "
                             f"new run with --model_name_or_path {output_dir} and another output_dir; to train "
                             "over it, pass --overwrite_output_dir true")
        if resume == "auto" and ckpt.read_run_id(output_dir) is not None:
            if is_world_process_zero():
                print(f"hf_zero3: no complete checkpoint in {output_dir} yet: starting from scratch", flush=True)
        elif resume == "auto":
            raise UsageError(f"output_dir {output_dir} holds files but no hf_zero3 run to resume: pass "
                             "--overwrite_output_dir true to train over it, or choose another output_dir")
        else:
            raise UsageError(f"output_dir {output_dir} already holds a run: pass --resume_from_checkpoint auto to "
                             "continue it, --overwrite_output_dir true to train over it, or choose another output_dir")
    old_checkpoints = sorted(p.name for p in ckpt.list_checkpoints(output_dir) if any(p.iterdir()))
    if args.overwrite_output_dir and old_checkpoints:
        # Keep-last-N ranks checkpoints by step: an old checkpoint-1000 would outrank (and so delete) this run's
        # checkpoint-200, and `resume auto` would later pick the old run. Nothing is deleted on the user's behalf.
        raise UsageError(f"output_dir {output_dir} holds checkpoints of an earlier run ({', '.join(old_checkpoints[:3])}"
                         f"{', ...' if len(old_checkpoints) > 3 else ''}): --overwrite_output_dir overwrites files but "
                         "does not mix checkpoints of two runs. Move or delete them, or choose another output_dir")
    return None


def _claim(output_dir: str) -> None:
    """Rank 0 records that a run owns output_dir (so its unfinished saves can be told from anyone else's) and
    that it is not finished; the other ranks wait for it."""
    from hf_zero3.checkpoint import lifecycle as ckpt

    _barrier()  # every rank has looked at output_dir before rank 0 writes into it
    if is_world_process_zero():
        ckpt.claim_output_dir(output_dir)
        ckpt.clear_finished(output_dir)
    _barrier()


def _load_model_and_tokenizer(model_args: ModelArguments, resume: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_zero3.checkpoint import lifecycle as ckpt

    source = model_args.model_name_or_path or model_args.config_name  # checked by _model_problems
    common = {"trust_remote_code": model_args.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(source, **common)
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or source, **common)
    except (OSError, ValueError) as e:  # hub ids offline, configs or tokenizers transformers cannot read
        raise UsageError(f"could not load {source}: {e}. Use a local folder, or a hub id with network access "
                         "(or a filled HF cache)") from e
    if model_args.config_overrides:
        try:
            config.update_from_string(model_args.config_overrides)
        except ValueError as e:  # a key the config does not have, a value of the wrong type
            raise UsageError(f"config_overrides {model_args.config_overrides!r}: {e}. Use key=value pairs, comma "
                             f"separated, with keys of {source}'s config.json") from e
    if resume and (differences := ckpt.shape_difference(resume, config)):
        raise UsageError(f"{resume} holds a model of another shape than this run's: {'; '.join(differences)}. Resume "
                         "with the model it was saved from (the model_name_or_path or config_name and config_overrides "
                         f"of that run: its config is {resume}/config.json), or train this model in another output_dir")
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
        try:
            model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config, **kwargs)
        except OSError as e:  # weights missing or unreadable
            raise UsageError(f"could not load the weights of {model_args.model_name_or_path}: {e}") from e
        except (ValueError, ImportError) as e:  # an attn_implementation that is unknown or not installed
            raise UsageError(f"could not build the model of {source}: {e}") from e
    else:
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except (ValueError, ImportError) as e:
            raise UsageError(f"could not build the model of {source}: {e}") from e
    return model, tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""A folder holding none of these has no tokenizer that AutoTokenizer can load."""


def _model_problems(values: dict[str, Any]) -> list[str]:
    """What is wrong with the model, config and tokenizer folders. A hub id is only tried when it loads."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    weights = {SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME}
    model, config = values.get("model_name_or_path"), values.get("config_name")
    if not (model or config):
        return ["no model given: set model_name_or_path (pretrained weights) or config_name (train from scratch)"]
    if model and values.get("config_overrides"):  # as HF's run_clm: the weights fix the shape they load into
        return [f"config_overrides ({values['config_overrides']}) reshape a config trained from scratch, but "
                f"model_name_or_path {model} loads pretrained weights: drop config_overrides (config_overrides null), "
                "or train from scratch with config_name"]
    tokenizer = "tokenizer_name" if values.get("tokenizer_name") else "model_name_or_path" if model else "config_name"
    problems = []
    for name, needs in (("model_name_or_path", "config.json weights"), ("config_name", "config.json"),
                        (tokenizer, "tokenizer")):
        value = values.get(name)
        if not value or (not os.path.exists(value) and not value.startswith((".", "/", "~")) and value.count("/") < 2):
            continue  # unset, or a hub id
        if not os.path.isdir(value):
            problems.append(f"{name} {value} {'is a file' if os.path.exists(value) else 'does not exist'}: point it "
                            "at a model folder (config.json inside) or a hub id like org/name")
            continue
        try:
            files = set(os.listdir(value))
            for file in files & {"config.json", *TOKENIZER_FILES}:
                with open(os.path.join(value, file), "rb"):  # a real open: os.access says yes to root
                    pass
        except OSError as e:
            problems.append(f"{name} {value}: {e.filename} cannot be read ({e.strerror}): fix its permissions")
            continue
        if "config.json" in needs and "config.json" not in files:
            problems.append(f"{name} {value} has no config.json: point it at the folder save_pretrained wrote "
                            "(config.json, weights, tokenizer), not its parent or a copy of some of its files")
        elif "weights" in needs and not files & weights:
            problems.append(f"{name} {value} has a config.json but no weights ({', '.join(sorted(weights))}): to "
                            "train from scratch pass it as config_name instead; to fine-tune, point it at the folder "
                            "with the weights")
        elif needs == "tokenizer" and not files & set(TOKENIZER_FILES):
            problems.append(f"{name} {value} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): set "
                            "tokenizer_name to the folder or hub id of the model's tokenizer")
    return problems


def training_values(values: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments values by name, defaults filled in, before the TrainingArguments object (and with it the
    DeepSpeed bridge and the device set-up) exists."""
    fields = [f for f in dataclasses.fields(TrainingArguments) if f.init and f.default is not dataclasses.MISSING]
    return {**{f.name: f.default for f in fields}, **values}


def _ds_config_problems(values: dict[str, Any], device: str) -> list[str]:
    """`hf-zero3 config check` on the ds_config with these TrainingArguments and this world size; warnings are
    printed (rank 0), errors returned."""
    from hf_zero3.config.check import check_ds_config, load_config

    source = values.get("deepspeed")
    if not source:
        return []
    name = "ds_config (inline)" if isinstance(source, dict) else f"ds_config {source}"
    try:
        config = source if isinstance(source, dict) else load_config(source)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    findings = check_ds_config(config, world_size=launched_world_size(), device=device,
                               training_args=training_values(values))
    if is_world_process_zero():
        for finding in findings:
            if finding.level == "warning":
                print(f"warning: {name}: {finding.key}: {finding.message}", file=sys.stderr, flush=True)
    return [f"{name}: {f.key}: {f.message}" for f in findings if f.level == "error"]


def _max_positions(values: dict[str, Any]) -> int | None:
    """The model's max positions from its config alone (a local folder, or a hub id already in the cache), with
    config_overrides applied; None when it cannot be known before loading."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(values.get("model_name_or_path") or values.get("config_name"),
                                            local_files_only=True, trust_remote_code=bool(values.get("trust_remote_code")))
        if values.get("config_overrides"):
            config.update_from_string(values["config_overrides"])
    except (OSError, ValueError):
        return None
    return getattr(config, "max_position_embeddings", None)


def check_inputs(values: dict[str, Any], device: str) -> None:
    """Every input (model folders, data files or dataset, the ds_config against TrainingArguments and the world size),
    checked on every rank before anything starts: all ranks stop, nothing is written, and all problems show at once."""
    problems = ["fp16 is not supported on CPU: drop --fp16 (fp32) or use --bf16 true"] \
        if device == "cpu" and values.get("fp16") else []
    problems += _model_problems(values)
    if not problems and (problem := block_size_problem(values.get("block_size", DataArguments.block_size),
                                                       _max_positions(values))):
        problems.append(problem)
    data, formats = _data_problems(values, with_tokenizer=not problems)
    problems += data
    if not problems and formats - {"text"} and values.get("packing", True):
        problems += _packing_problems(values)
    layers = values.get("gradient_checkpointing_layers")
    if layers is not None and not (values.get("gradient_checkpointing") or values.get("activation_checkpointing")):
        problems.append(f"gradient_checkpointing_layers {layers} needs gradient_checkpointing true: it chooses which "
                        "layers checkpointing covers; set gradient_checkpointing true or drop gradient_checkpointing_layers")
    elif layers is not None and int(layers) < 1:
        problems.append(f"gradient_checkpointing_layers must be >= 1 (got {layers}): to checkpoint no layer set "
                        "gradient_checkpointing false and drop gradient_checkpointing_layers")
    steps, epochs = (training_values(values)[k] for k in ("max_steps", "num_train_epochs"))
    if steps <= 0 and epochs <= 0:
        problems.append(f"nothing to train: max_steps is {steps} and num_train_epochs is {epochs}; set max_steps to "
                        "the optimizer steps to train (or num_train_epochs > 0, with max_steps -1)")
    try:
        parse_signals(values.get("preemption_signals", DEFAULT_SIGNALS))
    except ValueError as e:
        problems.append(str(e))
    problems += _ds_config_problems(values, device)
    problems += lora.problems(values)
    if problems:
        raise UsageError("\n".join(problems))


def _packing_problems(values: dict[str, Any]) -> list[str]:
    """Packed chat or prompt/completion data on a model whose attention would mix the examples of a block."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_zero3.data.collate import packing_problem

    try:
        config = AutoConfig.from_pretrained(values.get("model_name_or_path") or values.get("config_name"),
                                            local_files_only=True, trust_remote_code=bool(values.get("trust_remote_code")))
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (OSError, ValueError, KeyError):
        return []  # known once the model is built (remote code, a hub id not cached): checked again there
    problem = packing_problem(model_class, values.get("attn_implementation") or "sdpa")
    return [problem] if problem else []


def _data_problems(values: dict[str, Any], with_tokenizer: bool) -> tuple[list[str], set[str]]:
    """hf_zero3.data's checks of the data files, their formats and rows, and (`with_tokenizer`: the model's inputs
    are sound) the chat template on a sample; and the formats found."""
    from hf_zero3.data.build import data_problems

    def load_tokenizer():
        from transformers import AutoTokenizer

        name = values.get("tokenizer_name") or values.get("model_name_or_path") or values.get("config_name")
        try:
            return AutoTokenizer.from_pretrained(name, trust_remote_code=bool(values.get("trust_remote_code"))), name
        except (OSError, ValueError) as e:
            raise DataError(f"could not load the tokenizer {name} to check the chat data: {e}") from e

    return data_problems(values, load_tokenizer if with_tokenizer else None)


def _batching(prepared, model, tokenizer) -> dict[str, Any]:
    """The Trainer's collator (and eval metrics) for how the data was laid out; packing is refused where the model
    would let packed examples attend to each other."""
    from transformers import default_data_collator

    from hf_zero3.data import build, collate, metrics

    extra = {"compute_metrics": metrics.token_accuracy, "preprocess_logits_for_metrics": metrics.predicted_tokens}
    if prepared.layout == build.BLOCKS:
        return {"data_collator": default_data_collator, **extra}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if prepared.layout == build.PADDED:
        return {"data_collator": collate.PaddedCollator(pad), **extra}
    if problem := collate.packing_problem(type(model), collate.attention_of(model)):
        raise UsageError(problem)
    return {"data_collator": collate.PackedCollator(pad, flatten=collate.flattens(collate.attention_of(model))),
            **extra}


def _banner(trainer) -> str:
    args = trainer.args
    ds = args.hf_deepspeed_config.config if args.deepspeed else None
    stage = ds.get("zero_optimization", {}).get("stage", 0) if ds else "off (no deepspeed config)"
    facts = RunFacts.from_args(args, seq_len=0)
    return (f"hf_zero3: ZeRO stage {stage} | world size {args.world_size} | {facts.describe(args.world_size)} | "
            f"{facts.precision} | device {args.device}")


def _explain_oom(error: BaseException, model_config, training_args, seq_len: int,
                 trainable: int | None = None) -> None:
    """On an out-of-memory error, print the planner's next step as exact overrides (then the error is re-raised).
    `trainable`: a LoRA run's adapter parameters."""
    from hf_zero3.plan.oom import oom_advice_for_run, oom_kind

    kind = oom_kind(error)
    if kind is None:
        return
    try:
        advice = oom_advice_for_run(model_config, training_args, seq_len, host=kind == "host", trainable=trainable)
    except Exception as planner_error:  # noqa: BLE001 -- never hide the OOM behind a planner problem
        advice = f"(the planner could not suggest a next step: {planner_error})"
    print(f"[rank {os.environ.get('RANK', '0')}] hf_zero3: out of {'host' if kind == 'host' else 'GPU'} memory. "
          f"{advice}", file=sys.stderr, flush=True)


def _maybe_offload_activations(model, training_args) -> None:
    """Activation offload when asked by `activation_offload` or by the ds_config's `cpu_checkpointing`; the
    TrainingArguments field is set either way, so run_config.json records what ran."""
    from hf_zero3.run import activation_offload

    ds = training_args.hf_deepspeed_config.config if training_args.deepspeed else None
    by_ds = activation_offload.requested_by_ds_config(ds)
    if training_args.activation_offload is False and by_ds and is_world_process_zero():
        print("hf_zero3: activation offload off (activation_offload: false), although the ds_config's "
              "activation_checkpointing.cpu_checkpointing asks for it", flush=True)
    if training_args.activation_offload is False or not (training_args.activation_offload or by_ds):
        training_args.activation_offload = False
        return
    training_args.activation_offload = True
    activation_offload.enable(model)
    if is_world_process_zero():
        why = "ds_config activation_checkpointing.cpu_checkpointing" if by_ds else "activation_offload"
        decoder = type(activation_offload.decoder_of(model)).__name__
        print(f"hf_zero3: activation offload on ({why}): what {decoder} saves for backward lives in host memory",
              flush=True)


def _partial_checkpointing(model, training_args) -> list:
    """The callback that checkpoints only the first `gradient_checkpointing_layers` layers, checked against the
    model's layer count before anything starts; none when the option is unset."""
    if training_args.gradient_checkpointing_layers is None:
        return []
    from hf_zero3.callbacks.partial_checkpointing import PartialCheckpointingCallback, checked_layers

    checked_layers(model, training_args.gradient_checkpointing_layers)
    return [PartialCheckpointingCallback(training_args.gradient_checkpointing_layers)]


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


def _plot_line(out: Path, model_args, training_args) -> str:
    """train_log.png next to train_log.jsonl (loss, throughput, memory per step); the line that says where."""
    from hf_zero3.ops.plots import plot_train_log
    from hf_zero3.plan.hardware import gpu_name

    model = Path(model_args.model_name_or_path or model_args.config_name or "model").name
    return plot_train_log(out, f"{model} ({out.name}): {training_args.world_size} x {gpu_name() or 'CPU'}")


def run(argv: list[str], extra_callbacks: Sequence[Any] = ()) -> dict[str, float]:
    """Parse, set up, train, save; returns the final metrics. `extra_callbacks` go after ours (e.g. a probe)."""
    values = load_arguments(argv)
    on_cpu = bool(values.get("use_cpu")) or not cuda_available()
    if on_cpu:
        values["use_cpu"] = True
        if values.get("use_liger_kernel"):  # Liger's kernels are Triton GPU kernels; the same recipe runs on CPU
            print("hf_zero3: use_liger_kernel needs a GPU: off on CPU", flush=True)
            values["use_liger_kernel"] = False
    check_inputs(values, device="cpu" if on_cpu else "cuda")

    # Imported once the inputs are known good: the Trainer and the callbacks take seconds to import.
    from transformers import Trainer, set_seed

    from hf_zero3.callbacks import (
        DeepSpeedTimersCallback,
        HubPushCallback,
        NvmeResumeCallback,
        default_callbacks,
        install_callbacks,
    )
    from hf_zero3.callbacks.adapter_check import verify_on_all_ranks as verify_adapter_on_all_ranks
    from hf_zero3.callbacks.preemption import PreemptionCallback
    from hf_zero3.checkpoint.lifecycle import (
        CheckpointError,
        newest_complete,
        weights_gathered,
        write_finished,
    )
    from hf_zero3.data.build import build_datasets

    prepare_process_group(on_cpu=on_cpu, use_deepspeed=bool(values.get("deepspeed")))
    parser = ArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_dict(values, allow_extra_keys=False)
    preemption = PreemptionCallback(training_args.preemption_signals)  # before the model: loading takes long
    resume = _start_point(training_args)
    if resume == FINISHED:
        return {}
    _claim(training_args.output_dir)

    set_seed(training_args.seed)  # before the model: every rank (and every run) starts from the same weights
    model, tokenizer = _load_model_and_tokenizer(model_args, resume)
    if model_args.peft is not None:  # the adapter on the frozen base, partitioned with it when DeepSpeed starts
        try:
            model = lora.apply(model, lora.parse(model_args.peft), training_args)
        except ValueError as e:  # targets peft cannot adapt (checked before start where the config was at hand)
            raise UsageError(f"peft: {e}") from e
        if is_world_process_zero():
            print(lora.describe(model), flush=True)
    prepared = build_datasets(data_args, tokenizer, training_args, max_positions=model.config.max_position_embeddings,
                              tokenizer_name=model_args.tokenizer_name or model_args.model_name_or_path
                              or model_args.config_name)
    if is_world_process_zero():
        for note in prepared.notes:
            print(f"hf_zero3: data: {note}", flush=True)
    batching = _batching(prepared, model, tokenizer)
    try:
        sources = {"base_model": model_args.model_name_or_path,
                   "datasets": [data_args.dataset_name] if data_args.dataset_name else []}
        callbacks = [preemption, *default_callbacks(training_args, seq_len=round(prepared.attended), sources=sources,
                                                    tokens_per_sample=prepared.tokens_per_row,
                                                    lora=model_args.peft is not None),
                     *_partial_checkpointing(model, training_args), *extra_callbacks]
    except (CheckpointError, ValueError) as e:  # e.g. push_to_hub without a usable hub_model_id, a negative patience
        raise UsageError(str(e)) from e
    # CheckpointGuardCallback rotates over complete checkpoints and HubPushCallback uploads exported weights (both
    # took these settings above): the Trainer's own rotation and push (which would create the Hub repo in its
    # __init__ and upload whatever save_model wrote), blind to incomplete saves, stay off.
    by_callbacks = {"save_total_limit": training_args.save_total_limit, "push_to_hub": training_args.push_to_hub}
    training_args.save_total_limit, training_args.push_to_hub = None, False
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        processing_class=tokenizer,
        **batching,
    )
    _maybe_offload_activations(model, training_args)  # after the Trainer: Liger patches forwards in its __init__
    install_callbacks(trainer, [DeepSpeedTimersCallback(trainer), NvmeResumeCallback(trainer, resume), *callbacks])
    if trainer.is_world_process_zero():
        print(_banner(trainer), flush=True)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        _explain_oom(error, model.config, training_args, data_args.block_size, lora.trainable_params(model))
        raise
    if preemption.stopped_at is not None:  # a checkpoint, no final model: the run is not finished
        stopped = preemption.outcome(training_args.output_dir)
        release_engine(trainer)
        raise stopped
    metrics = dict(result.metrics)
    if training_args.save_final_model:
        trainer.save_model()
        if model_args.peft is not None and (problems := verify_adapter_on_all_ranks(model, training_args.output_dir)):
            raise CheckpointError(f"the final adapter in {training_args.output_dir} is not the trained one: "
                                  f"{'; '.join(problems[:5])}. The run is not marked finished")
        if trainer.is_world_process_zero():  # the final model is for inference: KV cache back on
            from hf_zero3.checkpoint.export import generation_ready

            generation_ready(Path(training_args.output_dir))
    trainer.save_state()
    if prepared.eval is not None:
        eval_metrics = trainer.evaluate()
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
        shards = training_args.save_final_model and model_args.peft is None and not weights_gathered(
            trainer.args.hf_deepspeed_config.config if trainer.args.deepspeed else None)
        write_finished(out, {"global_step": trainer.state.global_step, "max_steps": training_args.max_steps,
                             "num_train_epochs": training_args.num_train_epochs,
                             **({"zero_shards": (out / "latest").read_text().strip()} if shards else {})})
        newest = newest_complete(out)
        if shards:
            print(f"hf_zero3: final model: ZeRO shards in {out} (stage3_gather_16bit_weights_on_model_save is off, "
                  f"which keeps a 16-bit copy of the model out of rank 0's host RAM); a Hugging Face folder: "
                  f"hf-zero3 export {out} {out}-hf", flush=True)
        elif training_args.save_final_model:
            print(f"hf_zero3: final model: {out}", flush=True)
        if newest:
            print(f"hf_zero3: last checkpoint: {newest}", flush=True)
        print(f"hf_zero3: logs: {out / 'train_log.jsonl'} (and trainer_state.json)", flush=True)
        print(_plot_line(out, model_args, training_args), flush=True)
        print("hf_zero3: metrics: " + json.dumps({k: round(v, 4) for k, v in metrics.items()
                                                   if isinstance(v, float)}), flush=True)
    release_engine(trainer)  # its groups' threads end with the teardown, not in the interpreter's exit
    return metrics


ERROR_EXIT_DELAY_S = 5.0
"""After a usage error, ranks other than 0 wait this long before exiting. torchrun and the DeepSpeed launcher kill
every rank once the first one exits: were that not rank 0, its message (the only one) could be lost."""


def main(argv: list[str] | None = None, extra_callbacks: Sequence[Any] = ()) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from transformers import HfArgumentParser

        print("usage: hf-zero3 train [CONFIG.yaml] [--key value ...]\n")
        HfArgumentParser((ModelArguments, DataArguments, TrainingArguments)).print_help()
        return 0
    from hf_zero3.callbacks.nonfinite_guard import NonFiniteError
    from hf_zero3.callbacks.preemption import Preempted, release_all
    from hf_zero3.checkpoint.lifecycle import CheckpointError

    try:
        with process_group_released(UsageError, DataError, LaunchError, Preempted):
            run(argv, extra_callbacks)
    except Preempted as e:
        if is_world_process_zero():
            print(f"hf_zero3: {e}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    except (UsageError, DataError, LaunchError) as e:
        if is_world_process_zero():
            print("error: " + str(e).replace("\n", "\nerror: "), file=sys.stderr, flush=True)
        else:
            time.sleep(ERROR_EXIT_DELAY_S)
        return 2
    except (NonFiniteError, CheckpointError) as e:  # training stopped on purpose, the message says why and how on
        if is_world_process_zero():
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        release_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
