"""What the user says about their data: `DataArguments` (one HfArgumentParser dataclass, beside the model's and the
Trainer's) and `DataSource`, one entry of a mixture. A single `train_file` or `dataset_name` is a mixture of one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hf_zero3.data.errors import DataError

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""Supported local file extensions -> the `datasets` builder that reads them."""

FORMATS = ("auto", "text", "chat", "prompt_completion")
"""`auto` picks by columns: `messages` -> chat, `prompt` + `completion` -> prompt_completion, else text."""

OVERLONG = ("drop", "truncate")


@dataclass
class DataArguments:
    """Where the training data comes from, what format it is in, and how it becomes blocks of `block_size` tokens."""

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
    datasets: list[dict] | None = field(
        default=None, metadata={"help": "Several training datasets, mixed: a list of {path or name, format, weight or "
                                        "examples, ...} (see docs/data.md). Replaces train_file / dataset_name."}
    )
    data_format: str = field(
        default="auto", metadata={"help": "Format of train_file / dataset_name: auto (by columns), text, chat "
                                          "(a messages column), prompt_completion (prompt + completion columns)."}
    )
    text_column: str = field(default="text", metadata={"help": "Column that holds raw text."})
    messages_column: str = field(
        default="messages", metadata={"help": "Column that holds chat conversations (lists of {role, content})."}
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column that holds the prompt."})
    completion_column: str = field(default="completion", metadata={"help": "Column that holds the completion."})
    chat_template: str | None = field(
        default=None, metadata={"help": "Jinja chat template (a .jinja file, or the template itself) for tokenizers "
                                        "without one, or to replace theirs."}
    )
    train_on_inputs: bool = field(
        default=False, metadata={"help": "Train on every token of chat and prompt/completion data. Default: loss only "
                                         "on the assistant's turns and the completion."}
    )
    packing: bool = field(
        default=True, metadata={"help": "Pack chat and prompt/completion examples into block_size blocks, each "
                                        "attending only to itself (position_ids restart per example). false: one "
                                        "example per row, padded."}
    )
    overlong: str = field(
        default="drop", metadata={"help": "Chat and prompt/completion examples longer than block_size: drop them, "
                                          "or truncate them to block_size tokens. The run says how many."}
    )
    block_size: int = field(
        default=512, metadata={"help": "Tokens per training block (<= the model's max positions): raw text is cut "
                                       "into blocks of this size; longer examples are dropped or truncated."}
    )
    validation_split_percentage: int = field(
        default=0,
        metadata={"help": "Percent of train held out for eval when there is no validation file or split."},
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenization and packing."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep at most this many train rows: raw-text blocks, or chat and "
                                        "prompt/completion examples before packing (quick runs, tests)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep at most this many eval blocks."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Rebuild the tokenized/packed cache instead of reusing it."}
    )


class DataSource(BaseModel):
    """One training dataset: a local file (`path`) or a Hub dataset (`name`), its format and its share of the mix."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    """Local file (.txt, .json, .jsonl, .parquet, .csv)."""
    name: str | None = None
    """Hub dataset id (load_dataset), or a local folder load_dataset reads."""
    config: str | None = None
    """The Hub dataset's config name."""
    split: str = "train"
    """The split to train on (Hub datasets)."""
    format: Literal["auto", "text", "chat", "prompt_completion"] = "auto"
    weight: float | None = Field(default=None, gt=0)
    """Relative share of the mixed training examples (default 1 when no source gives `examples`)."""
    examples: int | None = Field(default=None, gt=0)
    """Exactly this many examples from this source (repeated when it has fewer)."""
    text_column: str = "text"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"

    @model_validator(mode="after")
    def _one_place_one_share(self) -> DataSource:
        if (self.path is None) == (self.name is None):
            raise ValueError("give exactly one of path (a local file) and name (a Hub dataset)")
        if self.weight is not None and self.examples is not None:
            raise ValueError("give weight or examples, not both")
        return self

    @property
    def label(self) -> str:
        """How messages name this source."""
        return self.path if self.path else f"{self.name}[{self.split}]"


def sources_of(data_args: DataArguments) -> list[DataSource]:
    """The training datasets, checked: `datasets` entries, or train_file / dataset_name as a mixture of one."""
    if data_args.data_format not in FORMATS:
        raise DataError(f"data_format {data_args.data_format!r} is not one of {', '.join(FORMATS)}.")
    if data_args.overlong not in OVERLONG:
        raise DataError(f"overlong {data_args.overlong!r} is not one of {', '.join(OVERLONG)}.")
    columns = {k: getattr(data_args, k) for k in ("text_column", "messages_column", "prompt_column",
                                                 "completion_column")}
    if data_args.datasets is not None:
        if data_args.train_file or data_args.dataset_name:
            raise DataError("datasets lists the training data, so train_file and dataset_name must be unset; put "
                            "that file in datasets as {path: ...} instead.")
        if not isinstance(data_args.datasets, list) or not data_args.datasets:
            raise DataError("datasets must be a non-empty list of {path: file} or {name: hub id} entries.")
        sources, problems = [], []
        for i, entry in enumerate(data_args.datasets):
            if not isinstance(entry, dict):
                problems.append(f"datasets[{i}] is {entry!r}, not a mapping like {{path: data/chat.jsonl}}")
                continue
            try:
                sources.append(DataSource(**{**columns, **entry}))
            except ValidationError as e:
                problems += [f"datasets[{i}]{''.join(f'.{p}' for p in err['loc'])}: {err['msg']}"
                             for err in e.errors()]
        if problems:
            raise DataError("; ".join(problems) + ". Each entry takes path or name, and optionally config, split, "
                            f"format ({', '.join(FORMATS)}), weight or examples, and the *_column names.")
        if any(s.examples is not None for s in sources) and any(s.weight is not None for s in sources):
            raise DataError("datasets mixes weight and examples across entries: use one of them for every entry "
                            "(weights are shares of the mix, examples are counts).")
        return sources
    if data_args.train_file:
        return [DataSource(path=data_args.train_file, format=data_args.data_format, **columns)]
    if data_args.dataset_name:
        return [DataSource(name=data_args.dataset_name, config=data_args.dataset_config_name,
                           format=data_args.data_format, **columns)]
    raise DataError("no training data: set train_file (a local file), dataset_name (a hub dataset) or datasets.")


def block_size_problem(block_size: int, max_positions: int | None) -> str | None:
    """What is wrong with block_size for a model with `max_positions` (None: not known yet)."""
    if block_size < 2:
        return f"block_size={block_size} is too small; causal LM blocks need block_size >= 2."
    if max_positions is not None and block_size > max_positions:
        return (f"block_size={block_size} exceeds the model's max positions ({max_positions}); "
                f"lower block_size to <= {max_positions}.")
    return None
