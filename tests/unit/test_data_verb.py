"""`hf-zero3 data`: the datasets train builds, without a process group or weights, and the trained tokens shown."""

from __future__ import annotations

import json

import datasets
import pytest
from transformers import AutoTokenizer

from hf_zero3.cli.main import main
from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.build import build_examples
from hf_zero3.data.tokenize import IGNORE
from tests.conftest import ROOT, TINY_YAML

CHAT = ROOT / "assets/tiny/chat"
ARGS = ["data", str(TINY_YAML), "--train_file", str(CHAT / "train.jsonl"), "--validation_file",
        str(CHAT / "validation.jsonl"), "--block_size", "256"]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")


def test_json_gives_the_examples_train_builds_with_their_trained_text(capsys):
    assert main([*ARGS, "--show", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    examples = [json.loads(line) for line in out.splitlines()]
    counts = json.loads(err.strip().splitlines()[-1])
    assert counts["examples"] == 3000 and counts["dropped"] == 0 and 1000 < counts["rows"] < 1100
    assert 0 < counts["padding_share"] < 0.05 and 0 < counts["trained_tokens"] < counts["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model")
    built = build_examples(DataArguments(train_file=str(CHAT / "train.jsonl"), block_size=256,
                                         validation_file=str(CHAT / "validation.jsonl")), tokenizer, 42, 512).train
    assert len(examples) == 2
    for example, ids, labels in zip(examples, built["input_ids"], built["labels"]):
        assert (example["input_ids"], example["labels"]) == (ids, labels)
        trained = [t for t in labels if t != IGNORE]
        assert "".join(example["trained_text"]) == tokenizer.decode(trained)
        assert example["trained_text"][0].startswith("the ") and example["trained_text"][0].endswith("</s>")


def test_the_text_view_marks_the_trained_tokens_and_a_bad_argument_is_named(capsys):
    assert main([*ARGS, "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "counts: layout packed, examples 3000" in out and "«the " in out and "</s>»" in out
    assert main([*ARGS, "--validation_file", str(ROOT / "assets/tiny/corpus/validation.txt")]) == 2
    assert "validation_file" in capsys.readouterr().err
