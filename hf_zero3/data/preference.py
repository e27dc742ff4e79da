"""Preference data for TRL's DPO-family and KTO trainers: loaded and mixed as SFT data is, each row checked, and
over-long pairs dropped whole (counted), never cut.

The rows stay in TRL's own formats (`prompt`/`chosen`/`rejected`, KTO's `prompt`/`completion`/`label`), as text or
as conversations; TRL renders conversations with the chat template and tokenizes them itself. What we add: one line
naming the row and the fix for a broken row, and the length check TRL does not do. TRL cuts prompt+chosen and
prompt+rejected at max_length separately, so a pair longer than block_size would be trained on two completions that
end at different places; such pairs are dropped here instead, and the run says how many.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import datasets

from hf_zero3.data.arguments import DataArguments, DataSource, sources_of
from hf_zero3.data.build import Prepared, _mixed_and_held_out, _what
from hf_zero3.data.errors import DataError
from hf_zero3.data.loading import load_file, load_source

PAIRED = "paired"
"""The layout of preference data: TRL's trainer batches and pads each pair (or KTO example) itself."""

SHOWN = 5


@dataclass(frozen=True)
class Columns:
    """The columns a preference stage reads: the answers it compares, and whether it needs a label column."""

    answers: tuple[str, ...]
    label: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return ("prompt", *self.answers, *((self.label,) if self.label else ()))


PAIRS = Columns(("chosen", "rejected"))
UNPAIRED = Columns(("completion",), label="label")


def _is_turns(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, dict) and "role" in t and "content" in t for t in value)


def _value_problem(value, name: str) -> str | None:
    if isinstance(value, str):
        return None if value.strip() else f"{name} is empty"
    if _is_turns(value):
        return None if value else f"{name} is an empty conversation"
    return f"{name} is {type(value).__name__}, not text or a list of {{role, content}} turns"


def _row_problem(row: dict, columns: Columns) -> str | None:
    """What is wrong with one row (None: nothing)."""
    for name in columns.answers:
        if problem := _value_problem(row[name], name):
            return problem
    if "prompt" in row and (problem := _value_problem(row["prompt"], "prompt")):
        return problem
    kinds = {isinstance(row[name], str) for name in ("prompt", *columns.answers) if name in row}
    if len(kinds) > 1:
        return "mixes text and conversations: give every column as text, or every column as turns"
    if columns.label and not isinstance(row[columns.label], bool):
        return (f"{columns.label} is {row[columns.label]!r}, not a boolean: write true (desirable) or false "
                "(undesirable)")
    return None


def row_problems(rows: datasets.Dataset, columns: Columns, what: str) -> None:
    """Every row checked (first few problems named), and chosen never equal to rejected on every row."""
    needed = [c for c in columns.names if c != "prompt" or not _conversational_answers(rows, columns)]
    if missing := [c for c in needed if c not in rows.column_names]:
        raise DataError(f"{what} has no {', '.join(missing)} column (columns: {rows.column_names}); preference data "
                        f"needs {', '.join(columns.names)}: rename the columns to these names")
    bad = []
    for i, row in enumerate(rows):
        if (problem := _row_problem(row, columns)) and len(bad) < SHOWN:
            bad.append(f"row {i + 1}: {problem}")
    if bad:
        raise DataError(f"{what}: {'; '.join(bad)}. Fix these rows or remove them")
    if columns is PAIRS and len(rows) and all(a == b for a, b in zip(rows["chosen"], rows["rejected"])):
        raise DataError(f"{what}: chosen equals rejected on every row, so there is no preference to learn: put the "
                        "preferred answer in chosen and the other one in rejected")


def _conversational_answers(rows: datasets.Dataset, columns: Columns) -> bool:
    """Conversations that carry the prompt inside chosen/rejected (TRL's implicit prompt) need no prompt column."""
    first = rows[0] if len(rows) else {}
    return all(_is_turns(first.get(name)) for name in columns.answers)


def _length_fn(tokenizer, columns: Columns):
    """Tokens of prompt + each answer, as TRL renders them (the chat template for conversations; text + EOS)."""
    def lengths(row):
        prompt = row.get("prompt") or ([] if _is_turns(row[columns.answers[0]]) else "")
        out = []
        for name in columns.answers:
            if isinstance(row[name], str):
                out.append(len(tokenizer(prompt + row[name])["input_ids"]) + 1)
            else:
                out.append(len(tokenizer.apply_chat_template(prompt + row[name], tokenize=True,
                                                             return_dict=True)["input_ids"]))
        return {"length": max(out), "tokens": sum(out)}
    return lengths


def _fingerprint(rows: datasets.Dataset, tokenizer, columns: Columns, block_size: int) -> str:
    """What the measured rows depend on, named without hashing the tokenizer object (`datasets` falls back to a random
    fingerprint for it, so every run would look new: the reference log-probs cached by it would never be reused)."""
    what = (rows._fingerprint, tokenizer.name_or_path, len(tokenizer), tokenizer.chat_template or "",
            tokenizer.eos_token, columns, block_size)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def _fitted(rows: datasets.Dataset, tokenizer, columns: Columns, block_size: int, label: str, map_args: dict):
    """The rows whose every sequence fits block_size (whole pairs dropped otherwise), and a note of the count."""
    key = _fingerprint(rows, tokenizer, columns, block_size)
    measured = rows.map(_length_fn(tokenizer, columns), desc=f"measure {label}", new_fingerprint=f"{key}-measured",
                        **map_args)
    kept = measured.filter(lambda n: n <= block_size, input_columns="length", new_fingerprint=f"{key}-fitted",
                           **map_args)
    dropped = len(measured) - len(kept)
    what = "pairs" if columns is PAIRS else "examples"
    note = [f"{label}: {dropped} {what} longer than block_size={block_size} dropped whole"] if dropped else []
    return kept, dropped, note


def load_checked(data_args: DataArguments, columns: Columns) -> list[tuple[DataSource, datasets.Dataset]]:
    """Every training source loaded and every row checked."""
    loaded = []
    for i, source in enumerate(sources_of(data_args)):
        what = _what(data_args, i)
        rows = load_source(source, what)
        row_problems(rows, columns, what)
        loaded.append((source, rows))
    return loaded


def build_preference(data_args: DataArguments, tokenizer, columns: Columns, seed: int) -> Prepared:
    """The train (and eval) rows for a preference stage: checked, fitted to block_size, mixed."""
    map_args = {"num_proc": data_args.preprocessing_num_workers, "load_from_cache_file": not data_args.overwrite_cache}
    parts, notes, dropped = [], [], 0
    for source, rows in load_checked(data_args, columns):
        kept, lost, note = _fitted(rows, tokenizer, columns, data_args.block_size, source.label, map_args)
        if len(kept) == 0:
            raise DataError(f"{source.label!r} has no row that fits block_size={data_args.block_size}: raise "
                            "block_size")
        parts.append((source, kept))
        notes += note
        dropped += lost
    evaluation = None
    if data_args.validation_file:
        rows = load_file(data_args.validation_file, "validation_file")
        row_problems(rows, columns, "validation_file")
        evaluation, _, note = _fitted(rows, tokenizer, columns, data_args.block_size, "validation_file", map_args)
        notes += note
    pct = 0 if evaluation is not None else data_args.validation_split_percentage
    train, held, mixed = _mixed_and_held_out(parts, pct, seed)
    evaluation = evaluation if evaluation is not None else held
    notes += mixed
    if data_args.max_train_samples is not None:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    if evaluation is not None and data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(len(evaluation), data_args.max_eval_samples)))
    tokens, longest = sum(train["tokens"]), train["length"]
    attended = sum(n * n for n in longest) / max(sum(longest), 1)
    train = train.remove_columns(["length", "tokens"])
    evaluation = evaluation.remove_columns(["length", "tokens"]) if evaluation is not None else None
    what = "pairs" if columns is PAIRS else "examples"
    notes.append(f"{len(train)} train {what}: {tokens} tokens of prompt and answers")
    return Prepared(train, evaluation, PAIRED, tokens, attended, notes, tokens, dropped)


def _answer_ids(tokenizer, prompt, answer) -> tuple[list[int], int]:
    """prompt + answer tokenized as TRL does (the chat template for conversations, EOS after text), and where the
    answer starts: where the tokens of the prompt alone and of prompt + answer part."""
    if isinstance(answer, str):
        prompt_ids = tokenizer(prompt or "")["input_ids"]
        ids = tokenizer((prompt or "") + answer)["input_ids"] + [tokenizer.eos_token_id]
    else:
        prompt_ids = tokenizer.apply_chat_template(prompt or [], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"] if prompt else []
        ids = tokenizer.apply_chat_template((prompt or []) + answer, tokenize=True, return_dict=True)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(prompt_ids), len(ids)))
    return ids, start


def preference_preview(data_args: DataArguments, tokenizer, columns: Columns, seed: int, show: int):
    """What `hf-zero3 data` shows for a preference stage: the counts, each shown row's answers ({input_ids, labels,
    answer}: the prompt's labels -100, the answer's its tokens), and the notes."""
    prepared = build_preference(data_args, tokenizer, columns, seed)
    examples = []
    for row in prepared.train.select(range(min(show, len(prepared.train)))):
        for name in columns.answers:
            ids, start = _answer_ids(tokenizer, row.get("prompt"), row[name])
            examples.append({"answer": name, "input_ids": ids, "labels": [-100] * start + ids[start:]})
    counts = {"layout": prepared.layout, "examples": len(prepared.train), "tokens": prepared.tokens,
              "dropped": prepared.dropped}
    return counts, examples, prepared.notes
