"""TRL's preference trainers (DPO, ORPO, SimPO, KTO) set up from our arguments, as `run.sft` sets up SFTTrainer.

The run's TrainingArguments object becomes the stage's TRL config in place (the DeepSpeed bridge and our callbacks
already hold it); `stage_args` fill TRL's own fields. The reference model, one of three ways, said in the banner:
- LoRA: none; TRL scores the reference with the adapter disabled (no second copy);
- precompute_ref_log_probs: one pass before training over each split (train, eval), as TRL does, its log-probs
  stored in output_dir/reference_logps/<split>/<hash>/ (a folder every rank reads), the hash of that split's rows,
  the tokenizer, chat template and reference weights; a resumed or repeated run with the same hash reads them back.
  Train log-probs of another hash are refused before the pass, naming what differs (they belong to another run: a
  new output_dir, or the folder deleted); eval ones of another hash (a new validation file) are computed anew;
- otherwise a second model, loaded exactly as the policy is (partitioned while it loads under ZeRO-3, the same
  attention kernel and leaf modules), which TRL wraps in an inference-only DeepSpeed engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import datasets
import deepspeed
import torch
import transformers
from trl import DPOConfig, KTOConfig
from trl.experimental.cpo import CPOConfig
from trl.experimental.orpo import ORPOConfig

from hf_zero3.data.build import Prepared
from hf_zero3.data.preference import build_preference
from hf_zero3.job.arguments import TrainingArguments
from hf_zero3.run.stages import STAGE_DEFAULTS, TRAINING_DEFAULTS, Stage


@dataclasses.dataclass
class DPOTrainingArguments(TrainingArguments, DPOConfig):
    """Our TrainingArguments read as a DPOConfig (never parsed: `as_stage_config`); module-level so checkpoints can
    pickle it."""


@dataclasses.dataclass
class KTOTrainingArguments(TrainingArguments, KTOConfig):
    """Our TrainingArguments read as a KTOConfig."""


@dataclasses.dataclass
class ORPOTrainingArguments(TrainingArguments, ORPOConfig):
    """Our TrainingArguments read as an ORPOConfig."""


@dataclasses.dataclass
class CPOTrainingArguments(TrainingArguments, CPOConfig):
    """Our TrainingArguments read as a CPOConfig (SimPO)."""


ARGUMENT_CLASSES = {"dpo": DPOTrainingArguments, "kto": KTOTrainingArguments, "orpo": ORPOTrainingArguments,
                    "simpo": CPOTrainingArguments}

REFERENCE_FOLDER = "reference_logps"


def as_stage_config(training_args: TrainingArguments, stage: Stage, data_args):
    """The run's TrainingArguments read by the stage's trainer as its TRL config, in place: TRL's own fields take
    their defaults, then the stage's defaults and `stage_args` (TRL's normalisations applied: a single loss type
    becomes a list where TRL keeps a list), then block_size as max_length."""
    mine = set(vars(training_args))
    config_class = stage.config_class()
    training_args.__class__ = ARGUMENT_CLASSES[stage.name]
    defaults = {}
    for f in dataclasses.fields(config_class):
        if f.name not in mine and f.init:
            defaults[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
            setattr(training_args, f.name, defaults[f.name])
    for key, value in {**STAGE_DEFAULTS.get(stage.name, {}), **(training_args.stage_args or {})}.items():
        setattr(training_args, key, [value] if isinstance(defaults.get(key), list) and
                not isinstance(value, list) else value)
    for key, value in TRAINING_DEFAULTS.get(stage.name, {}).items():
        if getattr(training_args, key) == transformers.TrainingArguments.__dataclass_fields__[key].default:
            setattr(training_args, key, value)
    if getattr(training_args, "pad_to_multiple_of", None) == "auto":  # resolved in TRL's __post_init__: None off Neuron
        training_args.pad_to_multiple_of = None
    training_args.max_length = data_args.block_size
    training_args.dataset_num_proc = data_args.preprocessing_num_workers
    return training_args


def build_data(stage: Stage, data_args, tokenizer, training_args) -> Prepared:
    """The preference rows, built on rank 0 first (the others read its cache)."""
    with training_args.main_process_first(desc="load and check preference data"):
        return build_preference(data_args, tokenizer, stage.columns, training_args.seed)


def weights_hash(model) -> str:
    """sha256 of the reference's weights, gathered one parameter at a time under ZeRO-3 (on every rank: a
    collective). TRL hashes `state_dict()`, which under ZeRO-3 holds only empty partitions: the same hash for any
    weights. With a LoRA adapter the reference is the frozen base (the adapter disabled): the adapter, new and
    randomly initialized, is left out, so another seed or rank keeps the base's hash."""
    digest = hashlib.sha256()
    adapter = hasattr(model, "peft_config")
    for name, param in sorted(model.named_parameters()):
        if adapter and param.requires_grad:  # the adapter's own weights: not the reference's
            continue
        if hasattr(param, "ds_id"):  # partitioned by ZeRO-3: gathered whole for the moment it is read
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                data = param.detach().to("cpu", torch.float32).numpy().tobytes()
        else:
            data = param.detach().to("cpu", torch.float32).numpy().tobytes()
        digest.update(name.encode())
        digest.update(data)
    return digest.hexdigest()


KEY_FILE = "key.json"
"""In each output_dir/reference_logps/<hash>/: the hashed parts, so a refusal can name the ones that differ."""


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode()).hexdigest()


def _rows_hash(dataset: datasets.Dataset) -> str:
    """The rows themselves, hashed by content: a moved or touched file, or another path to the same tokenizer, keeps
    the hash; `datasets`' fingerprints would not."""
    digest = hashlib.sha256(f"|{len(dataset)}|".encode())
    for batch in dataset.iter(batch_size=1000):
        digest.update(json.dumps(batch, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _tokenizer_hash(tokenizer) -> str:
    """The tokenizer's whole pipeline where it has one (fast tokenizers: vocabulary, merges, normalizer, the BOS its
    post-processor adds), else its vocabulary; and its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pipeline = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha(pipeline + json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))


def reference_parts(rows, tokenizer, weights: str) -> dict[str, str]:
    """What one split's precomputed reference log-probs depend on, each hashed (`weights`: `weights_hash` of the
    reference)."""
    return {"data": _rows_hash(rows), "tokenizer": _tokenizer_hash(tokenizer),
            "chat template": _sha(tokenizer.chat_template or ""), "reference weights": weights}


def key_of(parts: dict[str, str]) -> str:
    return _sha(json.dumps(parts, sort_keys=True))[:16]


def stored_reference_problem(folder: Path, parts: dict[str, str]) -> str | None:
    """Train log-probs already precomputed in `folder` (output_dir/reference_logps/train) under another hash: one line
    naming what differs and the fix; None when there are none or they are this run's (a resume reads them back)."""
    key = key_of(parts)
    others = sorted(p for p in folder.iterdir() if p.is_dir() and p.name != key) if folder.is_dir() else []
    if not others:
        return None
    try:
        theirs = json.loads((others[0] / KEY_FILE).read_text())["parts"]
        differ = [name for name, value in parts.items() if theirs.get(name) != value]
    except (OSError, ValueError, KeyError, TypeError):  # stored without its parts: say what the hash covers
        differ = []
    what = ", ".join(differ) if differ else "data, tokenizer, chat template or reference weights (not recorded)"
    return (f"stage_args.precompute_ref_log_probs: {others[0]} holds reference log-probs of the train rows precomputed "
            f"for another run (hash {others[0].name}; this run's is {key}; they differ in: {what}), so they cannot be "
            f"reused: train into a new --output_dir, or delete {others[0]} to compute them anew for this run")


def _stored_with_run(where: Path, parts: dict[str, str], rows, training_args) -> datasets.Dataset:
    """The rows saved once in `where` (output_dir/reference_logps/<split>/<hash>, with the parts hashed) and read back
    from there on every rank, so the cache files TRL writes next to them (the precomputed reference log-probs) are one
    set all ranks read: an in-memory dataset would send each rank's cache to its own temporary folder."""
    with training_args.main_process_first(desc="store the preference data with the run"):
        if training_args.process_index == 0:
            where.mkdir(parents=True, exist_ok=True)
            if not (where / KEY_FILE).is_file():
                (where / KEY_FILE).write_text(json.dumps({"key": where.name, "parts": parts}, indent=1) + "\n")
            if not (where / "rows" / "state.json").is_file():
                rows.save_to_disk(str(where / "rows"))
    return datasets.load_from_disk(str(where / "rows"))


def precomputed_reference_folders(args, train, evaluation, tokenizer, reference_model):
    """output_dir/reference_logps/<split>/<hash> for this run's train (and eval) rows, and the rows read back from
    there; ValueError (before the pass) when the output_dir holds train log-probs precomputed under another hash.
    Eval is keyed apart, so a new validation file on a resume computes only its own log-probs."""
    weights = weights_hash(reference_model)
    folders, rows = {}, {}
    for split, dataset in (("train", train), ("eval", evaluation)):
        if dataset is None:
            continue
        parts = reference_parts(dataset, tokenizer, weights)
        folder = Path(args.output_dir) / REFERENCE_FOLDER / split
        if split == "train" and (problem := stored_reference_problem(folder, parts)):
            raise ValueError(problem)
        folders[split] = folder / key_of(parts)
        rows[split] = _stored_with_run(folders[split], parts, dataset, args)
    return folders, rows.get("train"), rows.get("eval")


class StoredReferenceLogps:
    """Mixed into TRL's DPO/KTO trainer: each split's precomputed reference log-probs stored in
    `args.reference_logps_folders[split]` (keyed by its rows, tokenizer, chat template and reference weights) and read
    back from there by a resumed or repeated run. TRL's own cache never hits across runs: its tokenizing map hashes
    the tokenizer to a random fingerprint each time."""

    def _precompute_ref_logps(self, dataset, name, batch_size):
        folder = (getattr(self.args, "reference_logps_folders", None) or {}).get(name)
        if folder is None:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        stored = Path(folder) / "logps"
        if (stored / "state.json").is_file():
            logps = datasets.load_from_disk(str(stored))
            if len(logps) == len(dataset):
                return datasets.concatenate_datasets([dataset, logps], axis=1)
        computed = super()._precompute_ref_logps(dataset, name, batch_size)
        if self.accelerator.is_main_process:
            added = [c for c in computed.column_names if c not in dataset.column_names]
            computed.select_columns(added).save_to_disk(str(stored))
        self.accelerator.wait_for_everyone()
        return computed


def _stored_class(trainer_class: type) -> type:
    """TRL's trainer with the stored reference log-probs (a module-level name per class, so it pickles)."""
    name = f"Stored{trainer_class.__name__}"
    if name not in globals():
        globals()[name] = type(name, (StoredReferenceLogps, trainer_class), {"__module__": __name__})
    return globals()[name]


def reference_way(stage: Stage, model, model_args, training_args) -> str:
    """Which way the reference model is had, without local paths (the model card repeats it)."""
    if not stage.reference:
        return "none (reference-free loss)"
    if hasattr(model, "peft_config"):
        return "the base model with the LoRA adapter disabled (no second copy)"
    if getattr(training_args, "precompute_ref_log_probs", False):
        return "log-probs precomputed once before training"
    source = "another model" if model_args.ref_model_name_or_path else "the policy's starting weights"
    return f"a second model ({source}), inference-only DeepSpeed engine partitioned like the policy"


def preference_trainer(stage: Stage, model, tokenizer, model_args, data_args, training_args, prepared: Prepared,
                       load_reference: Callable[[], object]):
    """The stage's TRL trainer over the prepared rows, the reference model had the chosen way."""
    args = as_stage_config(training_args, stage, data_args)
    train, evaluation = prepared.train, prepared.eval
    kwargs = {}
    if stage.reference:
        separate = not hasattr(model, "peft_config") and (
            not args.precompute_ref_log_probs or model_args.ref_model_name_or_path)
        kwargs["ref_model"] = load_reference() if separate else None
        if args.precompute_ref_log_probs:
            folders, train, evaluation = precomputed_reference_folders(args, train, evaluation, tokenizer,
                                                                       kwargs["ref_model"] or model)
            args.reference_logps_folders = {split: str(where) for split, where in folders.items()}
    trainer_class = _stored_class(stage.trainer_class()) if getattr(args, "precompute_ref_log_probs", False) \
        else stage.trainer_class()
    trainer = trainer_class(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                    processing_class=tokenizer, **kwargs)
    _reference_without_a_copy(trainer.model)
    trainer.stage_description = describe(stage, args, reference_way(stage, model, model_args, args))
    return trainer


def _reference_without_a_copy(model) -> None:
    """TRL gives a model that comes with an adapter a frozen copy of it ("ref") to score the reference with, meant
    for an adapter trained before. Ours is new (peft's B = 0: the base's outputs), so the base with the adapter
    disabled is the same reference without the copy: no LoRA layers in each reference forward, no `ref/` adapter
    saved beside the trained one."""
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")


def describe(stage: Stage, args, reference: str) -> str:
    """The stage line of the run's banner (and of the model card): trainer, loss, beta, reference."""
    loss = getattr(args, "loss_type", stage.name)  # ORPO has one loss
    loss = loss if isinstance(loss, str) else "+".join(loss)
    return (f"stage {stage.name} (TRL {stage.trainer.split(':')[1]}) | loss {loss} | beta {args.beta} | "
            f"reference: {reference}")


def stage_banner(trainer) -> str:
    """The stage line of the run's banner: the card's, and where precomputed log-probs are cached."""
    folders = getattr(trainer.args, "reference_logps_folders", None)
    where = (f" in {', '.join(folders.values())} (each split reused while its rows, the tokenizer, chat template and "
             f"reference weights hash the same)" if folders and getattr(trainer.args, "precompute_ref_log_probs", False)
             else "")
    return f"hf_zero3: {trainer.stage_description}{where}"
