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


TEMPLATES = Path(trl.__file__).parent / "chat_templates"
"""The templates models ship, as TRL keeps them (byte for byte the Hub's): ChatML as Qwen2.5 writes it (with tool
calls), Llama 3, Llama 3.1 (its date block), Qwen3 (reasoning)."""
TOOL_ROW = {"messages": [
    {"role": "user", "content": "what is 2 times 3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "name": "multiply", "content": "6"},
    {"role": "assistant", "content": "2 times 3 is 6."}],
    "tools": [{"type": "function", "function": {"name": "multiply", "description": "a times b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]}


@pytest.mark.parametrize("name", ["qwen2_5", "llama3", "qwen3"])
def test_real_templates_train_what_trl_trains(tmp_path, tokenizer, name):
    """Templates without markers: ours and TRL's both render with TRL's training version of the template
    (`get_training_chat_template`), so ids and masks are TRL's. Differences kept on purpose: our first label is
    -100 (see above), and an end-of-turn token a template leaves outside its markers is trained by us (TRL warns)."""
    template = (TEMPLATES / f"{name}.jinja").read_text()
    tok = tokenizer.__class__.from_pretrained(ASSETS / "model")
    tok.chat_template = template
    rows = _lines("train.jsonl")[:20]
    tool_rows = [TOOL_ROW] if name != "llama3" else []  # Llama 3's template knows no tools
    theirs = [*_trl_rows(tmp_path, rows, tok, assistant_only_loss=True),  # apart: one dataset would give every
              *(_trl_rows(tmp_path, tool_rows, tok, assistant_only_loss=True) if tool_rows else [])]  # turn None keys
    ours = Tokenizer(tok, template, train_on_inputs=False)
    assert ours.from_trl and ours.use_markers
    for row, their in zip(rows + tool_rows, theirs, strict=True):
        mine = ours.chat(row["messages"], row.get("tools"))
        assert mine["input_ids"] == their["input_ids"]
        trained_by_us_only = [i for i, (a, b) in enumerate(zip(mine["labels"], their["labels"])) if a != b]
        assert all(their["labels"][i] == IGNORE and tok.convert_ids_to_tokens(mine["input_ids"][i]) in
                   ("<|eot_id|>", "<|im_end|>", "</s>") for i in trained_by_us_only), row
    if tool_rows:  # the assistant's call is trained, the tool's output is not
        trained = tok.decode([t for t in mine["labels"] if t != IGNORE])
        assert "multiply" in trained and "2 times 3 is 6." in trained and "\n6\n" not in trained


def test_llama_3_1_which_trl_refuses_trains_the_assistant_s_turns_and_not_its_date_block(tmp_path, tokenizer):
    """A difference kept on purpose: TRL has no training version of Llama 3.1's template and refuses it for
    assistant-only loss; ours finds the assistant's tokens from the turns' renderings, the date block untrained."""
    template = (TEMPLATES / "llama3_1.jinja").read_text()
    tok = tokenizer.__class__.from_pretrained(ASSETS / "model")
    tok.chat_template = template
    rows = _lines("train.jsonl")[:20]
    with pytest.raises(ValueError, match="not training-compatible"):
        _trl_rows(tmp_path, rows, tok, assistant_only_loss=True)
    ours = Tokenizer(tok, template, train_on_inputs=False)
    assert not ours.from_trl and not ours.use_markers
    for row in rows:
        example = ours.chat(row["messages"])
        trained = tok.decode([t for t in example["labels"] if t != IGNORE])
        assert trained == "".join(m["content"] + "<|eot_id|>" for m in row["messages"] if m["role"] == "assistant")
        assert "Cutting Knowledge Date" in tok.decode(example["input_ids"])
