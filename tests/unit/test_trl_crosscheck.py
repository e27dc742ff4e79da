"""Our token ids and loss masks against what a peer builds from the same rows: TRL's `SFTTrainer` with its
assistant-only loss (chat) and completion-only loss (prompt/completion), on the shipped tiny tokenizer.

One difference is on purpose: our first label of every example is -100. In an unpacked row the Trainer's shifted
loss never uses it; in a packed row it would be the next example's first token predicted from the previous
example's last one, which is cross-talk. TRL's first label is -100 too wherever the row starts with a prompt token
(BOS, a system or user turn), so rows equal once that one position is left out."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_zero3.data.tokenize import IGNORE, Tokenizer

trl = pytest.importorskip("trl")

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "tiny"
ROWS = 200


def _trl_rows(tmp_path, rows: list[dict], tokenizer, **config) -> datasets.Dataset:
    """The train dataset SFTTrainer prepares (input_ids, labels) from `rows`, unpacked and untruncated."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], packing=False, max_length=None,
                         use_cpu=True, **config)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)
    return trainer.train_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "model")


def _lines(name: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / "chat" / name).read_text().splitlines()[:ROWS]]


@pytest.mark.parametrize("use_markers", [True, False], ids=["generation-markers", "turn-offsets"])
def test_chat_ids_and_mask_equal_trl_assistant_only_loss(tmp_path, tokenizer, use_markers):
    """TRL reads the mask from the template's {% generation %} markers; ours equals it both when we read them too
    and when we find the assistant's tokens from the turns' renderings (the way for templates without markers)."""
    rows = _lines("train.jsonl")
    theirs = _trl_rows(tmp_path, rows, tokenizer, assistant_only_loss=True)
    ours = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False, use_markers=use_markers)
    for row, their in zip(rows, theirs, strict=True):
        mine = ours.chat(row["messages"])
        assert mine["input_ids"] == their["input_ids"]
        assert their["labels"][0] == IGNORE  # the row starts with BOS, a prompt token
        assert mine["labels"] == their["labels"], row


def test_prompt_completion_ids_and_mask_equal_trl_completion_only_loss(tmp_path, tokenizer):
    """Both append EOS to a text completion and train from where prompt and prompt+completion diverge."""
    rows = _lines("instructions.jsonl")
    theirs = _trl_rows(tmp_path, rows, tokenizer, completion_only_loss=True)
    ours = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False)
    for row, their in zip(rows, theirs, strict=True):
        mine = ours.prompt_completion(row["prompt"], row["completion"])
        assert mine["input_ids"] == their["input_ids"]
        assert mine["labels"] == their["labels"], row
