"""Load a causal-LM dataset, tokenize it and pack it into fixed-size blocks.

Packing (documents joined with EOS, cut into `block_size` chunks) means no padding and no wasted
compute, so the stock `Trainer` with its default collator can batch the blocks as they are. Every
step goes through `datasets.map`, so results are cached by fingerprint and built only once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from itertools import chain

import datasets

logger = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""Supported local file extensions -> the `datasets` builder that reads them."""

PACK_BATCH_SIZE = 1000
"""Documents packed together per map batch; each batch drops its own remainder (< block_size tokens)."""


class DataError(ValueError):
    """Bad data input; the message names the fix."""


@dataclass
class DataArguments:
    """Where the training text comes from and how it is cut into blocks."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, loaded with datasets.load_dataset(name, config)."}
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "Config name of the hub dataset."}
    )
    train_file: str | None = field(
        default=None, metadata={"help": f"Local training file ({', '.join(BUILDERS)})."}
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "Local evaluation file, same formats."}
    )
    text_column: str = field(default="text", metadata={"help": "Column that holds the text."})
    block_size: int = field(
        default=512, metadata={"help": "Tokens per packed training block (<= the model's max positions)."}
    )
    validation_split_percentage: int = field(
        default=0,
        metadata={"help": "Percent of train held out for eval when there is no validation file or split."},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenization and packing."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep at most this many packed train blocks (quick runs, tests)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep at most this many packed eval blocks."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Rebuild the tokenized/packed cache instead of reusing it."}
    )


def file_problem(path: str, what: str) -> str | None:
    """What is wrong with a local data file (None: nothing), so `hf-zero3 train` can stop before anything starts."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in BUILDERS:
        return f"{what} {path!r} has unsupported extension {ext or '(none)'!r}; use one of: {', '.join(BUILDERS)}."
    if os.path.isdir(path):
        return f"{what} {path!r} is a folder; point {what} at one file."
    if not os.path.isfile(path):
        return (f"{what} {path!r} does not exist (resolved relative to the current directory "
                f"{os.getcwd()!r} as {os.path.abspath(path)!r}); fix the path or run from another directory.")
    try:
        with open(path, "rb"):  # a real open: os.access says yes to root
            pass
    except OSError as e:
        return f"{what} {path!r} cannot be read ({e.strerror}); fix its permissions or copy it somewhere readable."
    if os.path.getsize(path) == 0:
        return f"{what} {path!r} is empty; point {what} at a file with text in it."
    return None


def _load_file(path: str, what: str) -> datasets.Dataset:
    """One local file as a Dataset, with errors that say what to change."""
    if problem := file_problem(path, what):
        raise DataError(problem)
    return datasets.load_dataset(BUILDERS[os.path.splitext(path)[1].lower()], data_files=path, split="train")


def _not_loaded(name: str, error: Exception) -> str:
    return (f"dataset_name {name!r} could not be loaded: {error}. Without network access (or with HF_HUB_OFFLINE=1) "
            "only datasets already in the HF cache load: run once where the Hub is reachable to fill the cache "
            "(HF_HOME), or pass train_file with a local file instead.")


def dataset_problem(name: str, config: str | None) -> str | None:
    """What stops a hub dataset from loading (None: nothing), found before anything starts: offline, not in the
    cache, no such dataset or config. Only its metadata is fetched here."""
    try:
        datasets.load_dataset_builder(name, config)
    except OSError as e:  # ConnectionError without network or with HF_HUB_OFFLINE=1; DatasetNotFoundError
        return _not_loaded(name, e)
    except ValueError as e:  # e.g. an unknown config name
        return f"dataset_name {name!r} with dataset_config_name {config!r}: {e}"
    return None


def _load_raw(data_args: DataArguments, seed: int) -> datasets.DatasetDict:
    """Raw text as a DatasetDict with "train" and, if there is one, "validation"."""
    if data_args.train_file:
        raw = datasets.DatasetDict({"train": _load_file(data_args.train_file, "train_file")})
    elif data_args.dataset_name:
        try:
            raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
        except (OSError, ValueError) as e:  # checked by dataset_problem already, unless the Hub went away since
            raise DataError(_not_loaded(data_args.dataset_name, e)) from e
        if "train" not in raw:
            raise DataError(
                f"dataset {data_args.dataset_name!r} has no 'train' split (splits: {sorted(raw)}); "
                "pass train_file instead."
            )
        raw = datasets.DatasetDict({k: raw[k] for k in ("train", "validation") if k in raw})
    else:
        raise DataError("no training data: set train_file (a local file) or dataset_name (a hub dataset).")

    if data_args.validation_file:
        raw["validation"] = _load_file(data_args.validation_file, "validation_file")
    elif "validation" not in raw and data_args.validation_split_percentage:
        pct = data_args.validation_split_percentage
        if not 0 < pct < 100:
            raise DataError(
                f"validation_split_percentage={pct}; it must be between 1 and 99 (or 0 for none)."
            )
        try:
            split = raw["train"].train_test_split(test_size=pct / 100, seed=seed)
        except ValueError as e:  # a split that leaves train empty
            raise DataError(
                f"validation_split_percentage={pct} cannot split {len(raw['train'])} train rows ({e}); "
                "give more data or a validation_file."
            ) from e
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    return raw


def _check_text_column(raw: datasets.DatasetDict, column: str) -> None:
    """Fail before tokenizing if a split lacks the text column, it is not text, or it is empty."""
    for name, ds in raw.items():
        if column not in ds.column_names:
            raise DataError(
                f"text_column {column!r} not found in the {name} data; its columns are {ds.column_names}. "
                "Set text_column to one of them."
            )
        dtype = getattr(ds.features[column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise DataError(
                f"text_column {column!r} of the {name} data holds {ds.features[column]}, not text; "
                "point text_column at a string column."
            )
        if len(ds) == 0:
            raise DataError(f"the {name} data has no rows; give it a file or split with text in {column!r}.")


def block_size_problem(block_size: int, max_positions: int | None) -> str | None:
    """What is wrong with block_size for a model with `max_positions` (None: not known yet)."""
    if block_size < 2:
        return f"block_size={block_size} is too small; causal LM blocks need block_size >= 2."
    if max_positions is not None and block_size > max_positions:
        return (f"block_size={block_size} exceeds the model's max positions ({max_positions}); "
                f"lower block_size to <= {max_positions}.")
    return None


def build_datasets(
    data_args: DataArguments, tokenizer, training_args, max_positions: int
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Train and eval (or None) datasets of packed blocks with columns `input_ids` and `labels`.

    No `attention_mask`: blocks are never padded, and causal LMs treat a missing mask as all ones.
    """
    block_size = data_args.block_size
    if problem := block_size_problem(block_size, max_positions):
        raise DataError(problem)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; set one (documents are joined with EOS).")

    column = data_args.text_column

    def tokenize(batch):
        """Token ids per document, EOS-terminated; empty documents vanish. Special tokens the tokenizer
        adds itself (e.g. a Llama BOS) stay, and an EOS it already appends is not doubled."""
        texts = [t for t in batch[column] if t and not t.isspace()]
        ids = tokenizer(texts)["input_ids"] if texts else []
        return {"input_ids": [x if x and x[-1] == eos else x + [eos] for x in ids]}

    def pack(batch):
        flat = list(chain.from_iterable(batch["input_ids"]))
        n = len(flat) // block_size * block_size
        blocks = [flat[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    common = dict(
        batched=True,
        num_proc=data_args.preprocessing_num_workers,
        load_from_cache_file=not data_args.overwrite_cache,
    )
    tokenized, packed = {}, {}
    # Rank 0 loads (downloads), tokenizes and packs first; the others then read its cache. A bad input fails on
    # rank 0 first, which still reaches the barrier (main_process_first's finally), so nobody hangs.
    with training_args.main_process_first(desc="load, tokenize and pack"):
        raw = _load_raw(data_args, training_args.seed)
        _check_text_column(raw, column)
        for name, ds in raw.items():  # per split: a validation file may have other columns than train
            tokenized[name] = ds.map(
                tokenize, remove_columns=ds.column_names, desc=f"tokenize {name}", **common
            )
            packed[name] = tokenized[name].map(
                pack, batch_size=PACK_BATCH_SIZE, desc=f"pack {name} into {block_size}-token blocks", **common
            )

    for name, ds in packed.items():
        if len(ds) == 0:
            # An all-empty map output keeps its input schema (datasets quirk), so count rows first.
            n_tokens = sum(len(x) for x in tokenized[name]["input_ids"]) if len(tokenized[name]) else 0
            if n_tokens == 0:
                raise DataError(f"the {name} data has no text in column {column!r}; give it non-empty text.")
            raise DataError(
                f"the {name} data has only {n_tokens} tokens, fewer than one block "
                f"(block_size={block_size}); "
                f"use a smaller block_size (<= {n_tokens}) or more data."
            )

    train, evaluation = packed["train"], packed.get("validation")
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if evaluation is not None and data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))
    logger.info("packed %d train blocks, %s eval blocks", len(train), len(evaluation) if evaluation else 0)
    return train, evaluation
