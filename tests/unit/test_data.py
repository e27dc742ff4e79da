"""hf_zero3.data against real `datasets` loading and the shipped tiny tokenizer (no mocks)."""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer, TrainingArguments

from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.build import build_datasets
from hf_zero3.data.errors import DataError

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "tiny"
BLOCK = 64
MAX_POS = 512


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Own datasets cache per test, offline: `datasets` reads these at import, so patch the config too."""
    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", cache / "downloads" / "extracted")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "model")


@pytest.fixture(scope="module")
def training_args(tmp_path_factory):
    # Module-scoped: building TrainingArguments costs ~1 s each on CPU.
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True, report_to=[])


@pytest.fixture(scope="module")
def docs():
    lines = (ASSETS / "corpus" / "train.txt").read_text().splitlines()
    return lines[:40]


def write(path: Path, docs: list[str], column: str = "text") -> Path:
    """Write `docs` in the format named by the path's extension."""
    rows = [{column: d} for d in docs]
    if path.suffix == ".txt":
        path.write_text("".join(d + "\n" for d in docs))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        ds = datasets.Dataset.from_list(rows)
        {".jsonl": ds.to_json, ".parquet": ds.to_parquet, ".csv": lambda p: ds.to_csv(p, index=False)}[
            path.suffix
        ](str(path))
    return path


def expected_stream(tokenizer, docs: list[str]) -> list[int]:
    """What packing must produce, computed by hand: each non-empty doc's ids, then EOS."""
    eos = tokenizer.eos_token_id
    return list(chain.from_iterable(tokenizer(d)["input_ids"] + [eos] for d in docs if d.strip()))


def build(training_args, tokenizer, **kw):
    kw.setdefault("block_size", BLOCK)
    prepared = build_datasets(DataArguments(**kw), tokenizer, training_args, MAX_POS)
    return prepared.train, prepared.eval


def flat(ds) -> list[int]:
    return list(chain.from_iterable(ds["input_ids"]))


def test_packing_matches_hand_tokenization(tmp_path, tokenizer, training_args, docs):
    train, evaluation = build(training_args, tokenizer, train_file=str(write(tmp_path / "t.txt", docs)))
    assert evaluation is None
    assert train.column_names == ["input_ids", "labels"]
    assert len(train) > 10 and all(len(x) == BLOCK for x in train["input_ids"])
    assert train["labels"] == train["input_ids"]

    stream = expected_stream(tokenizer, docs)
    kept = len(stream) // BLOCK * BLOCK
    assert len(stream) - kept < BLOCK  # only the remainder is dropped
    assert flat(train) == stream[:kept]
    # EOS sits exactly at each document's end.
    first = tokenizer(docs[0])["input_ids"]
    assert flat(train)[len(first)] == tokenizer.eos_token_id
    assert flat(train).count(tokenizer.eos_token_id) == stream[:kept].count(tokenizer.eos_token_id) > 5


def test_blank_lines_are_skipped_not_doubled_eos(tmp_path, tokenizer, training_args, docs):
    with_gaps = list(chain.from_iterable((d, "", "   ") for d in docs))
    train, _ = build(training_args, tokenizer, train_file=str(write(tmp_path / "t.txt", with_gaps)))
    clean, _ = build(training_args, tokenizer, train_file=str(write(tmp_path / "c.txt", docs)))
    assert train["input_ids"] == clean["input_ids"]


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_format_gives_the_same_blocks(tmp_path, tokenizer, training_args, docs, ext):
    reference, _ = build(training_args, tokenizer, train_file=str(write(tmp_path / "t.txt", docs)))
    train, _ = build(training_args, tokenizer, train_file=str(write(tmp_path / f"t{ext}", docs)))
    assert train["input_ids"] == reference["input_ids"]


def test_text_column_and_extra_columns(tmp_path, tokenizer, training_args, docs):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    train, _ = build(training_args, tokenizer, train_file=str(path), text_column="body")
    assert train.column_names == ["input_ids", "labels"]
    assert flat(train) == expected_stream(tokenizer, docs)[: len(flat(train))]


def test_validation_file(tmp_path, tokenizer, training_args, docs):
    train, evaluation = build(
        training_args,
        tokenizer,
        train_file=str(write(tmp_path / "t.txt", docs[:30])),
        validation_file=str(write(tmp_path / "v.jsonl", docs[30:])),  # may differ in format from train
    )
    stream = expected_stream(tokenizer, docs[30:])
    assert flat(evaluation) == stream[: len(stream) // BLOCK * BLOCK]
    assert flat(train) == expected_stream(tokenizer, docs[:30])[: len(flat(train))]


def test_validation_split_percentage(tmp_path, tokenizer, training_args, docs):
    path = str(write(tmp_path / "t.txt", docs))
    full, _ = build(training_args, tokenizer, train_file=path)
    train, evaluation = build(training_args, tokenizer, train_file=path, validation_split_percentage=25)
    assert evaluation is not None and len(evaluation) > 0
    assert len(train) + len(evaluation) <= len(full) < len(train) + len(evaluation) + 2
    again_train, again_eval = build(training_args, tokenizer, train_file=path, validation_split_percentage=25)
    assert again_eval["input_ids"] == evaluation["input_ids"]  # deterministic (seeded by training_args.seed)
    assert again_train["input_ids"] == train["input_ids"]


def test_dataset_validation_split(tmp_path, tokenizer, training_args, docs):
    """dataset_name also takes a local folder; its validation.* file becomes the eval split."""
    folder = tmp_path / "mydata"
    folder.mkdir()
    write(folder / "train.txt", docs[:30])
    write(folder / "validation.txt", docs[30:])
    train, evaluation = build(training_args, tokenizer, dataset_name=str(folder))
    assert flat(evaluation) == expected_stream(tokenizer, docs[30:])[: len(flat(evaluation))]
    assert len(train) > len(evaluation) > 0


def test_max_samples_cap(tmp_path, tokenizer, training_args, docs):
    path = str(write(tmp_path / "t.txt", docs))
    train, evaluation = build(
        training_args,
        tokenizer,
        train_file=path,
        validation_file=path,
        max_train_samples=3,
        max_eval_samples=2,
    )
    assert len(train) == 3 and len(evaluation) == 2
    big, _ = build(training_args, tokenizer, train_file=path, max_train_samples=10_000)
    assert len(big) > 3


def test_second_build_reuses_the_cache(tmp_path, tokenizer, training_args, docs):
    path = str(write(tmp_path / "t.txt", docs))
    first, _ = build(training_args, tokenizer, train_file=path)
    second, _ = build(training_args, tokenizer, train_file=path)
    assert first.cache_files == second.cache_files  # same fingerprint -> same cache file


def _cases(tmp: Path, docs: list[str]) -> dict[str, tuple[dict, list[str]]]:
    """name -> (DataArguments kwargs, substrings the message must contain)."""
    (tmp / "empty.txt").write_text("")
    (tmp / "blank.txt").write_text("\n  \n\n")
    (tmp / "notes.md").write_text("hello\n")
    small = write(tmp / "small.txt", docs[:1])
    body = tmp / "body.jsonl"
    body.write_text(json.dumps({"body": "hi", "id": 1}) + "\n")
    return {
        "no source": (dict(), ["train_file", "dataset_name"]),
        "missing file": (dict(train_file=str(tmp / "nope.txt")), ["nope.txt", "current directory"]),
        "bad extension": (
            dict(train_file=str(tmp / "notes.md")),
            [".md", ".txt", ".json", ".jsonl", ".parquet", ".csv"],
        ),
        "empty file": (dict(train_file=str(tmp / "empty.txt")), ["empty"]),
        "no text": (dict(train_file=str(tmp / "blank.txt")), ["no text", "'text'"]),
        "missing column": (dict(train_file=str(body)), ["text_column", "'body'", "'id'"]),
        "block too big": (
            dict(train_file=str(small), block_size=MAX_POS + 1),
            ["block_size", f"<= {MAX_POS}"],
        ),
        "block too small": (dict(train_file=str(small), block_size=1), ["block_size >= 2"]),
        "too few tokens": (dict(train_file=str(small), block_size=MAX_POS), ["tokens", "smaller block_size"]),
        "missing validation": (
            dict(train_file=str(small), validation_file=str(tmp / "val.csv")),
            ["validation_file", "val.csv"],
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["no source", "missing file", "bad extension", "empty file", "no text", "missing column",
     "block too big", "block too small", "too few tokens", "missing validation"],
)  # fmt: skip
def test_data_errors_name_the_fix(tmp_path, tokenizer, training_args, docs, case):
    kwargs, needles = _cases(tmp_path, docs)[case]
    kwargs.setdefault("block_size", BLOCK)
    with pytest.raises(DataError) as err:
        build_datasets(DataArguments(**kwargs), tokenizer, training_args, MAX_POS)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_small_file_token_count_in_message(tmp_path, tokenizer, training_args, docs):
    path = write(tmp_path / "one.txt", docs[:1])
    n = len(expected_stream(tokenizer, docs[:1]))
    with pytest.raises(DataError, match=rf"only {n} tokens.*block_size={MAX_POS}"):
        build(training_args, tokenizer, train_file=str(path), block_size=MAX_POS)
