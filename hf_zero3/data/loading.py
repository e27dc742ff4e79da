"""Load one data source (a local file or a Hub dataset) as a `datasets.Dataset`, and say exactly what is wrong with
a file `datasets` cannot read: the line of a broken JSON record, the byte that is not UTF-8, a binary file."""

from __future__ import annotations

import codecs
import json
import os

import datasets

from hf_zero3.data.arguments import BUILDERS, DataSource
from hf_zero3.data.errors import DataError

SCAN_LIMIT_BYTES = 1 << 30
"""A broken file is read back to find its bad line only up to this size (the error says so past it)."""


def file_problem(path: str, what: str) -> str | None:
    """What is wrong with a local data file that shows without reading it (None: nothing)."""
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
        return f"{what} {path!r} is empty; point {what} at a file with data in it."
    return None


def _not_loaded(name: str, error: Exception, what: str = "dataset") -> str:
    return (f"{what} {name!r} could not be loaded: {error}. Without network access (or with HF_HUB_OFFLINE=1) "
            "only datasets already in the HF cache load: run once where the Hub is reachable to fill the cache "
            "(HF_HOME), or train on a local file instead (train_file, or a path: entry in datasets).")


def dataset_problem(name: str, config: str | None, what: str = "dataset_name") -> str | None:
    """What stops a hub dataset from loading (None: nothing), found before anything starts: offline, not in the
    cache, no such dataset or config. Only its metadata is fetched here."""
    try:
        datasets.load_dataset_builder(name, config)
    except OSError as e:  # ConnectionError without network or with HF_HUB_OFFLINE=1; DatasetNotFoundError
        return _not_loaded(name, e, what)
    except ValueError as e:  # e.g. an unknown config name
        return f"{what} {name!r} with config {config!r}: {e}"
    return None


def _encoding_problem(path: str, what: str) -> str | None:
    """Where a file stops being UTF-8 text, as line and byte, with the likely cause (None: it is UTF-8)."""
    with open(path, "rb") as f:
        data = f.read(SCAN_LIMIT_BYTES)
    for bom, name in ((codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
                      (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32")):
        if data.startswith(bom):
            return (f"{what} {path!r} is {name} text, not UTF-8; convert it: iconv -f {name} -t UTF-8 {path} > "
                    "out.txt")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.end == len(data) and len(data) == SCAN_LIMIT_BYTES:
            return None  # a character cut by the scan limit, not by the file
        line = data.count(b"\n", 0, e.start) + 1
        if b"\0" in data[:8192]:
            return (f"{what} {path!r} is not text (it holds NUL bytes: a binary file?); point {what} at a text "
                    "file.")
        return (f"{what} {path!r} is not UTF-8: byte 0x{data[e.start]:02x} at line {line} (byte offset {e.start}). "
                f"Convert it, e.g. iconv -f latin1 -t UTF-8 {path} > out{os.path.splitext(path)[1]} (use the "
                "file's real encoding).")
    return None


def _json_problem(path: str, what: str) -> str | None:
    """The first line of a JSON-lines file that is not one JSON object, or where a JSON array file stops parsing."""
    with open(path, encoding="utf-8") as f:
        if f.read(4096).lstrip().startswith("["):  # one JSON array of records
            if os.path.getsize(path) > SCAN_LIMIT_BYTES:
                return None
            f.seek(0)
            try:
                json.load(f)
            except json.JSONDecodeError as e:
                return f"{what} {path!r}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}. Fix it there."
            return None
        f.seek(0)
        read = 0
        for number, line in enumerate(f, 1):
            read += len(line)
            if read > SCAN_LIMIT_BYTES:
                return None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                return (f"{what} {path!r}: line {number} is not valid JSON ({e.msg} at column {e.colno}). A .jsonl "
                        "file holds one JSON object per line: fix or remove that line.")
            if not isinstance(record, dict):
                return (f"{what} {path!r}: line {number} is a JSON {type(record).__name__}, not an object; each "
                        'line must be an object such as {"messages": [...]} or {"text": "..."}.')
    return None


def diagnose(path: str, what: str, error: Exception) -> str:
    """The clearest message for a local file `datasets` failed to read."""
    problem = _encoding_problem(path, what)
    if problem is None and BUILDERS[os.path.splitext(path)[1].lower()] == "json":
        problem = _json_problem(path, what)
    if problem is None:
        cause = error.__cause__ or error.__context__ or error
        problem = (f"{what} {path!r} could not be read as {os.path.splitext(path)[1]}: {type(cause).__name__}: "
                   f"{str(cause)[:500]}. Check that the file matches its extension.")
    return problem


def load_file(path: str, what: str) -> datasets.Dataset:
    """One local file as a Dataset, with errors that say what to change."""
    if problem := file_problem(path, what):
        raise DataError(problem)
    builder = BUILDERS[os.path.splitext(path)[1].lower()]
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:
        raise DataError(diagnose(path, what, e)) from e


def load_hub(name: str, config: str | None) -> datasets.DatasetDict:
    """A Hub dataset (or a local folder `load_dataset` reads) with all its splits."""
    try:
        loaded = datasets.load_dataset(name, config)
    except (OSError, ValueError) as e:  # checked by dataset_problem already, unless the Hub went away since
        raise DataError(_not_loaded(name, e)) from e
    if not isinstance(loaded, datasets.DatasetDict):
        loaded = datasets.DatasetDict({"train": loaded})
    return loaded


def load_source(source: DataSource, what: str) -> datasets.Dataset:
    """The rows of one training source; `what` names it in errors (train_file, datasets[1], ...)."""
    if source.path:
        return load_file(source.path, what)
    loaded = load_hub(source.name, source.config)
    if source.split not in loaded:
        raise DataError(f"dataset {source.name!r} has no {source.split!r} split (splits: {sorted(loaded)}); set "
                        "split to one of them, or use a local file.")
    return loaded[source.split]
