"""Which format a dataset is in (raw text, chat, prompt/completion), and every row that does not fit it, named by
its line or row, found before anything is tokenized."""

from __future__ import annotations

import os

import datasets

from hf_zero3.data.arguments import DataSource
from hf_zero3.data.errors import DataError
from hf_zero3.parsing import ParseError, parse_json

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a chat turn may have; the tokenizer's chat template decides how each is rendered."""

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
"""ShareGPT's `conversations` turns ({from, value}) read as {role, content}."""

ALPACA = ("instruction", "input", "output")
"""Alpaca's columns: trained as a prompt (the instruction, then the input when there is one) and its completion."""

SHOWN = 5
"""Bad rows listed in one error; the rest are counted."""

SCAN_BATCH = 2048


def detect(columns: list[str], source: DataSource, what: str) -> str:
    """The source's format: as given, or from its columns; an error naming the columns when they do not fit."""
    wanted = {"chat": [source.messages_column], "prompt_completion": [source.prompt_column, source.completion_column],
              "text": [source.text_column]}
    if source.format != "auto":
        missing = [c for c in wanted[source.format] if c not in columns]
        if source.format == "chat" and missing and "conversations" in columns:
            return "chat"
        if missing:
            column_args = {"chat": "messages_column", "prompt_completion": "prompt_column / completion_column",
                           "text": "text_column"}[source.format]
            raise DataError(f"{what} {source.label!r} is given as {source.format} but has no column "
                            f"{', '.join(map(repr, missing))}; its columns are {columns}. Set {column_args} to the "
                            "column that holds it, or the format that matches the file.")
        return source.format
    for fmt in ("chat", "prompt_completion", "text"):
        if all(c in columns for c in wanted[fmt]):
            return fmt
    if "conversations" in columns:
        return "chat"
    if ALPACA[0] in columns and ALPACA[2] in columns:
        return "alpaca"
    raise DataError(f"{what} {source.label!r} has columns {columns}, which fit no format: chat needs a "
                    f"{source.messages_column!r} column (a list of {{role, content}} turns), prompt_completion needs "
                    f"{source.prompt_column!r} and {source.completion_column!r}, raw text needs {source.text_column!r}. "
                    "Rename the columns or set messages_column / prompt_column / completion_column / text_column.")


def messages_column_of(columns: list[str], source: DataSource) -> str:
    return source.messages_column if source.messages_column in columns else "conversations"


def as_messages(turns: list) -> list[dict]:
    """Turns as {role, content, ...} dicts: ShareGPT's {from, value} mapped, content given as a list of text parts
    joined into its text, keys holding None dropped."""
    messages = []
    for turn in turns:
        if "from" in turn and "role" not in turn:
            turn = {"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": turn.get("value"),
                    **{k: v for k, v in turn.items() if k not in ("from", "value")}}
        content = turn.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            turn = {**turn, "content": "".join(part.get("text") or "" for part in turn["content"])}
        messages.append({k: v for k, v in turn.items() if v is not None})
    return messages


def alpaca_row(instruction: str, given: str | None, output: str, conversational: bool) -> tuple:
    """An Alpaca row as (prompt, completion): a user turn and the assistant's where a chat template renders them,
    else text."""
    prompt = instruction + (f"\n\n{given}" if given else "")
    if conversational:
        return [{"role": "user", "content": prompt}], [{"role": "assistant", "content": output}]
    return prompt + "\n\n", output


def _content_problem(content, role: str, k: int) -> str | None:
    if isinstance(content, list):
        kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
        if kinds - {"text"}:
            return (f"turn {k} ({role}) has content parts of type {', '.join(sorted(map(str, kinds - {'text'})))}; "
                    "only text parts ({type: text, text: ...}) are trained")
        return None
    if content is not None and not isinstance(content, str):
        return f"turn {k} ({role}) has content of type {type(content).__name__}; content must be text"
    return None


def turns_problem(turns, *, need_assistant: bool) -> str | None:
    """What is wrong with one conversation (None: nothing)."""
    if not isinstance(turns, list):
        return f"is {type(turns).__name__}, not a list of {{role, content}} turns"
    if not turns:
        return "is an empty conversation"
    for k, turn in enumerate(as_messages(turns) if all(isinstance(t, dict) for t in turns) else turns):
        if not isinstance(turn, dict):
            return f"turn {k} is {type(turn).__name__}, not a {{role, content}} mapping"
        role = turn.get("role")
        if role not in ROLES:
            return (f"turn {k} has role {role!r}; roles are {', '.join(ROLES)}" if role is not None
                    else f"turn {k} has no role")
        content = turn.get("content")
        if content is None and not (role == "assistant" and turn.get("tool_calls")):
            return f"turn {k} ({role}) has no content"
        if problem := _content_problem(content, role, k):
            return problem
    if need_assistant and not any(t.get("role") == "assistant" for t in as_messages(turns)):
        return ("has no assistant turn, so nothing in it is trained (the loss is on the assistant's turns): drop it, "
                "or set train_on_inputs true to train on every token")
    return None


def tools_of(value):
    """A `tools` column holds JSON schemas, as objects or as a JSON string (TRL's convention); a ParseError says
    where a string stops being JSON."""
    return parse_json(value, "its tools column", "Write tools as a JSON list of function schemas, or that list "
                      "itself rather than a string") if isinstance(value, str) else value


def _tools_problem(value) -> str | None:
    try:
        tools_of(value)
    except ParseError as e:
        return str(e)
    return None


def _completion_problem(prompt, completion) -> str | None:
    if isinstance(prompt, str) and isinstance(completion, str):
        return None if completion else "has an empty completion: nothing in it is trained"
    if isinstance(prompt, list) and isinstance(completion, list):
        if problem := turns_problem(prompt, need_assistant=False):
            return f"prompt {problem}"
        if problem := turns_problem(completion, need_assistant=True):
            return f"completion {problem}"
        return None
    return (f"has a {type(prompt).__name__} prompt and a {type(completion).__name__} completion; both must be text, "
            "or both lists of {role, content} turns")


def _row_names(source: DataSource):
    """Row index -> how a user finds it: the line of a .jsonl (blank lines skipped, as `datasets` does), else the
    row number."""
    path = source.path
    if path and os.path.splitext(path)[1].lower() == ".jsonl":
        with open(path, encoding="utf-8") as f:
            lines = [n for n, line in enumerate(f, 1) if line.strip()]
        return lambda i: f"line {lines[i]}" if i < len(lines) else f"row {i + 1}"
    return lambda i: f"row {i + 1}"


def row_problems(ds: datasets.Dataset, fmt: str, source: DataSource, what: str, *, need_assistant: bool) -> None:
    """Raise one DataError listing the rows that do not fit `fmt` (the first few, and how many in all)."""
    if len(ds) == 0:
        raise DataError(f"{what} {source.label!r} has no rows; give it data.")
    bad: list[tuple[int, str]] = []
    count = 0
    if fmt == "text":
        column = source.text_column
        dtype = getattr(ds.features[column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise DataError(f"text_column {column!r} of {what} {source.label!r} holds {ds.features[column]}, not "
                            "text; point text_column at a string column.")
        return
    columns = ([messages_column_of(ds.column_names, source)] if fmt == "chat" else [ALPACA[0], ALPACA[2]]
               if fmt == "alpaca" else [source.prompt_column, source.completion_column])
    tools = ["tools"] if "tools" in ds.column_names else []
    for start in range(0, len(ds), SCAN_BATCH):
        batch = ds[start:start + SCAN_BATCH]
        for offset, values in enumerate(zip(*(batch[c] for c in columns + tools))):
            problem = (turns_problem(values[0], need_assistant=need_assistant) if fmt == "chat"
                       else _completion_problem(*values[:2])) or (_tools_problem(values[-1]) if tools else None)
            if problem:
                count += 1
                if len(bad) < SHOWN:
                    bad.append((start + offset, problem))
    if bad:
        name = _row_names(source)
        listed = "; ".join(f"{name(i)} {problem}" for i, problem in bad)
        more = f" (and {count - len(bad)} more rows)" if count > len(bad) else ""
        raise DataError(f"{what} {source.label!r} ({fmt}): {listed}{more}. Fix or remove these rows.")
