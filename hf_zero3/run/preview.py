"""What a run would train on, before paying for GPUs: the datasets `train` builds from the same arguments (the same
checks, mixture, masks and over-long rule, and TRL's own packing), in this process alone: no process group, no
weights. `hf-zero3 data` prints it (`cli/data.py`)."""

from __future__ import annotations

from typing import Any

from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.build import PACKED, build_examples
from hf_zero3.data.preference import preference_preview
from hf_zero3.data.tokenize import IGNORE
from hf_zero3.job.arguments import ArgumentParser, ModelArguments, TrainingArguments, UsageError, load_arguments
from hf_zero3.run.stages import stage_of


def _tokenizer_and_positions(model_args: ModelArguments):
    """The run's tokenizer and its model's max positions, from the config alone (no weights)."""
    from transformers import AutoConfig, AutoTokenizer

    source = model_args.model_name_or_path or model_args.config_name
    if not source:
        raise UsageError("no model: set model_name_or_path (or config_name) as for train")
    common = {"trust_remote_code": model_args.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(source, **common)
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or source, **common)
    except (OSError, ValueError) as e:
        raise UsageError(f"could not load {source}: {e}") from e
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    return tokenizer, config.max_position_embeddings


def trained_spans(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The trained tokens, decoded, one string per run of consecutive trained tokens, in order."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return [*runs, tokenizer.decode(current)] if current else runs


def marked(tokenizer, ids: list[int], labels: list[int], start: str = "«", end: str = "»") -> str:
    """The example's text with each run of trained tokens between `start` and `end`."""
    text, run, inside = [], [], None
    for token, label in zip(ids, labels):
        trained = label != IGNORE
        if inside is not None and trained != inside:
            piece = tokenizer.decode(run)
            text.append(f"{start}{piece}{end}" if inside else piece)
            run = []
        run.append(token)
        inside = trained
    if run:
        piece = tokenizer.decode(run)
        text.append(f"{start}{piece}{end}" if inside else piece)
    return "".join(text)


def preview(argv: list[str], show: int) -> tuple[dict[str, Any], list[dict], list[str], Any]:
    """The counts of the train data, its first `show` examples ({input_ids, labels, trained_text}), the run's notes
    and the tokenizer, from train's YAML and overrides."""
    from trl import pack_dataset

    values = load_arguments(argv)  # every key checked against train's three dataclasses
    model_args, data_args = ArgumentParser((ModelArguments, DataArguments)).parse_dict(values, allow_extra_keys=True)
    tokenizer, max_positions = _tokenizer_and_positions(model_args)
    if (stage := stage_of(values)).columns is not None:  # a preference stage: each answer's trained span
        seed = int(values.get("seed", TrainingArguments.seed))
        return (*preference_preview(data_args, tokenizer, stage.columns, seed, show), tokenizer)
    prepared = build_examples(data_args, tokenizer, int(values.get("seed", TrainingArguments.seed)), max_positions,
                              model_args.tokenizer_name or model_args.model_name_or_path or model_args.config_name)
    train, block = prepared.train, data_args.block_size
    lengths = list(map(len, train["input_ids"]))
    if prepared.layout == PACKED:  # as SFTTrainer packs them (shuffle_dataset is off)
        rows = len(pack_dataset(train.select_columns(["input_ids", "labels"]), block, "bfd"))
        room = rows * block
    else:  # raw-text blocks are full; padded rows are as wide as their micro batch's longest, here in file order
        micro = int(values.get("per_device_train_batch_size", TrainingArguments.per_device_train_batch_size))
        rows, room = len(train), sum(max(lengths[i:i + micro]) * len(lengths[i:i + micro])
                                     for i in range(0, len(lengths), micro))
    counts = {"layout": prepared.layout, "examples": len(train), "tokens": prepared.tokens,
              "trained_tokens": prepared.trained, "dropped": prepared.dropped, "rows": rows,
              "padding_share": round(1 - sum(lengths) / max(room, 1), 4)}
    examples = [{"input_ids": ids, "labels": labels, "trained_text": trained_spans(tokenizer, ids, labels)}
                for ids, labels in zip(train["input_ids"][:show], train["labels"][:show])]
    return counts, examples, prepared.notes, tokenizer
