"""Chat and prompt/completion data: formats, loss masks, packing without cross-talk, mixtures and bad data, on the
shipped tiny tokenizer and its chat template, real `datasets` loading and a real (tiny) Llama."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.build import BLOCKS, PACKED, PADDED, build_datasets, data_problems
from hf_zero3.data.errors import DataError
from hf_zero3.data.packing import packing_problem
from hf_zero3.data.tokenize import IGNORE, Tokenizer

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "tiny"
CHAT = ASSETS / "chat" / "train.jsonl"
INSTRUCTIONS = ASSETS / "chat" / "instructions.jsonl"
BLOCK = 256
MAX_POS = 512

# Llama 3's chat template as its tokenizer_config.json ships it (tools left out): no {% generation %} markers, so
# the assistant's tokens are found from the turns' own renderings.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt "
    "%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
# Qwen2.5's chat template as it ships (tools left out): a default system prompt when the conversation has none.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == "
    "\"system\" and not loop.first) or (message.role == \"assistant\") %}{{- '<|im_start|>' + message.role + '\n' + "
    "message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}{%- endif %}")
# A template that, like some reasoning models', drops an earlier assistant turn's thinking once a user follows.
DROPS_THINKING = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and not loop.last %}<a>{{ m.content.split('</think>')[-1] }}"
    "</a>{%- elif m.role == 'assistant' %}<a>{{ m.content }}</a>{%- else %}<{{ m.role }}>{{ m.content }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<a>{%- endif %}")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "model")


@pytest.fixture(scope="module")
def training_args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True, report_to=[], seed=3)


@pytest.fixture(scope="module")
def conversations():
    return [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()[:300]]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trained_text(tokenizer, example) -> list[str]:
    """The trained tokens of an example, decoded, one string per run of consecutive trained tokens."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


# -- loss masks --------------------------------------------------------------------------------------------------------

def test_chat_trains_exactly_the_assistant_turns_and_their_eos(tokenizer, conversations):
    tok = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False)
    assert tok.use_markers  # the tiny template marks the assistant's text with {% generation %}
    for messages in conversations:
        example = tok.chat(messages)
        assert example["input_ids"] == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)[
            "input_ids"]
        answers = [m["content"] + "</s>" for m in messages if m["role"] == "assistant"]
        assert [t.strip() for t in trained_text(tokenizer, example)] == answers, messages
        assert example["labels"][0] == IGNORE


def test_turn_offsets_give_the_same_mask_as_generation_markers(tokenizer, conversations):
    """The mask found from the turns' renderings (templates without markers) equals transformers'
    return_assistant_tokens_mask on a template with markers."""
    markers = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False, use_markers=True)
    offsets = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False, use_markers=False)
    for messages in conversations:
        assert offsets.chat(messages) == markers.chat(messages)


def test_a_template_without_markers_trains_the_content_and_end_of_turn(tokenizer):
    tok = Tokenizer(tokenizer, LLAMA3_TEMPLATE, train_on_inputs=False)
    assert not tok.use_markers
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what does the cow say?"},
                {"role": "assistant", "content": "the cow says moo."}, {"role": "user", "content": "and the owl?"},
                {"role": "assistant", "content": "the owl says hoot."}]
    runs = trained_text(tokenizer, tok.chat(messages))
    assert [r.strip() for r in runs] == ["the cow says moo.<|eot_id|>", "the owl says hoot.<|eot_id|>"]


@pytest.mark.parametrize("template, end", [(LLAMA3_TEMPLATE, "<|eot_id|>"), (QWEN25_TEMPLATE, "<|im_end|>")],
                         ids=["llama3", "qwen2.5"])
def test_a_conversation_opening_with_the_assistant_trains_none_of_the_templates_preamble(tokenizer, template, end):
    """Llama 3's BOS and header, Qwen2.5's default system prompt: rendered before the first turn, trained by none."""
    tok = Tokenizer(tokenizer, template, train_on_inputs=False)
    messages = [{"role": "assistant", "content": "how can I help?"}, {"role": "user", "content": "say moo."},
                {"role": "assistant", "content": "moo."}]
    assert [r.strip() for r in trained_text(tokenizer, tok.chat(messages))] == [f"how can I help?{end}",
                                                                                f"moo.{end}"]


def test_an_end_of_turn_token_left_outside_the_markers_is_trained_and_said(tmp_path, training_args, tokenizer):
    """A template whose {% generation %} stops before the end-of-turn token would never teach the model to stop."""
    template = ("{%- for m in messages %}<{{ m.role }}>{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{%- else %}{{ m.content }}{%- endif %}{{ eos_token }}{%- endfor %}")
    tok = Tokenizer(tokenizer, template, train_on_inputs=False)
    messages = [{"role": "user", "content": "say moo."}, {"role": "assistant", "content": "moo."}]
    assert [r.strip() for r in trained_text(tokenizer, tok.chat(messages))] == ["moo.</s>"]
    prepared = build(training_args, tokenizer, train_file=str(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])),
                     chat_template=template)
    assert any("</s>" in note and "generation" in note and "trained" in note for note in prepared.notes)


def test_train_on_inputs_trains_every_token_but_the_first(tokenizer, conversations):
    tok = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=True)
    example = tok.chat(conversations[0])
    assert example["labels"][1:] == example["input_ids"][1:] and example["labels"][0] == IGNORE


def test_a_template_that_drops_earlier_thinking_trains_each_turn_in_the_context_it_renders(tokenizer):
    """Where earlier turns render differently once later ones follow (reasoning templates that drop past thinking,
    and that TRL has no training version of), each assistant turn is an example of its own: its context rendered
    as the template renders it at inference (earlier thinking dropped), only that turn trained."""
    tok = Tokenizer(tokenizer, DROPS_THINKING, train_on_inputs=False)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>x</think>hello"},
             {"role": "user", "content": "and?"}, {"role": "assistant", "content": "<think>y</think>bye"}]
    first, second = tok.chat_examples(turns)
    assert [r.strip() for r in trained_text(tokenizer, first)] == ["<think>x</think>hello</a>"]
    assert [r.strip() for r in trained_text(tokenizer, second)] == ["<think>y</think>bye</a>"]
    assert "<think>x" not in tokenizer.decode(second["input_ids"]) and "hello" in tokenizer.decode(second["input_ids"])


def test_text_parts_a_developer_turn_and_alpaca_rows_train_without_a_template_of_ours(tmp_path, training_args,
                                                                                       tokenizer):
    tok = Tokenizer(tokenizer, QWEN25_TEMPLATE, train_on_inputs=False)  # knows no developer role: rendered as system
    parts = [{"role": "developer", "content": "be brief."},
             {"role": "user", "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "moo."}]},
             {"role": "assistant", "content": [{"type": "text", "text": "moo."}]}]
    example = tok.chat_examples(parts)[0]
    assert "<|im_start|>system\nbe brief." in tokenizer.decode(example["input_ids"]) and "say moo." in \
        tokenizer.decode(example["input_ids"])
    assert [r.strip() for r in trained_text(tokenizer, example)] == ["moo.<|im_end|>"]
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "name the animal.", "input": "it says moo.", "output": "a cow."},
        {"instruction": "say hello.", "input": "", "output": "hello."}])
    prepared = build(training_args, tokenizer, train_file=str(alpaca))
    runs = [[r.strip() for r in trained_text(tokenizer, dict(zip(("input_ids", "labels"), row)))]
            for row in zip(prepared.train["input_ids"], prepared.train["labels"])]
    assert runs == [["a cow.</s>"], ["hello.</s>"]]
    assert "it says moo." in tokenizer.decode(prepared.train["input_ids"][0])


def test_prompt_completion_trains_the_completion_and_eos(tokenizer):
    tok = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False)
    example = tok.prompt_completion("question: what color is the sky?\nanswer:", " the sky is blue.")
    assert example["input_ids"] == tokenizer("question: what color is the sky?\nanswer: the sky is blue.")[
        "input_ids"] + [tokenizer.eos_token_id]
    assert [r.strip() for r in trained_text(tokenizer, example)] == ["the sky is blue.</s>"]
    conversational = tok.prompt_completion([{"role": "user", "content": "hi"}],
                                           [{"role": "assistant", "content": "hello"}])
    assert [r.strip() for r in trained_text(tokenizer, conversational)] == ["hello</s>"]


# -- packing -----------------------------------------------------------------------------------------------------------

def _tiny_model(attention: str, lora: bool = False):
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(ASSETS / "model")
    config._attn_implementation = attention
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).float()
    if lora:  # peft's wrapper passes position_ids (and the flattened layout's keys) on to the model
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                                 init_lora_weights=False))  # B not zero: A gets gradients too
    return model


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def _packed_batch(tokenizer, examples: list[dict], flatten: bool = False) -> dict:
    """The examples as the run batches them: packed by TRL's `pack_dataset` (bfd, SFTTrainer's default strategy),
    then flattened into one row by TRL's padding-free collator (flash attention), or one packed block per row
    (`run.sft.PackedRows`, other attention); position_ids restart per example either way."""
    from trl import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_zero3.run.sft import PackedRows

    rows = datasets.Dataset.from_list([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples])
    packed = pack_dataset(rows, BLOCK, "bfd")
    assert 1 < len(packed) < len(examples)  # several examples share a block
    collate = DataCollatorForLanguageModeling(tokenizer.pad_token_id, padding_free=True) if flatten \
        else PackedRows(tokenizer.pad_token_id)
    batch = collate(list(packed))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == (1 if flatten else len(packed))
    # SFTTrainer's compute_loss turns the KV cache off, as the run's model config does: with one transformers would
    # not build the packed-sequence mask
    return {**{k: v for k, v in batch.items() if k != "seq_idx"}, "use_cache": False}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_packed_loss_and_gradients_equal_the_examples_run_one_by_one(tokenizer, conversations, attention, flatten,
                                                                     lora):
    """fp32, CPU: a micro batch of packed blocks, as TRL packs and collates them, gives the loss and gradients of its
    examples run alone, token-weighted (the mean over trained tokens); the whole model, and a LoRA adapter on a
    frozen base (the packing check looks through peft's wrapper)."""
    tok = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False)
    examples = [tok.chat(m) for m in conversations[:12]]
    model = _tiny_model(attention, lora)
    packed_loss, packed_grads = _loss_and_grads(model, _packed_batch(tokenizer, examples, flatten))

    total = sum(sum(1 for t in e["labels"][1:] if t != IGNORE) for e in examples)
    alone_loss, alone_grads = 0.0, [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    for e in examples:
        n = sum(1 for t in e["labels"][1:] if t != IGNORE)
        loss, grads = _loss_and_grads(model, {"input_ids": torch.tensor([e["input_ids"]]),
                                              "labels": torch.tensor([e["labels"]])})
        alone_loss += loss * n / total
        alone_grads = [a + g * n / total for a, g in zip(alone_grads, grads)]
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(packed_grads, alone_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_on_cpu_trls_lm_head_scores_only_the_trained_positions(tokenizer, conversations, monkeypatch):
    """TRL's chunked LM head, as SFTTrainer adds it, scores on CPU only the positions with a label (as TRL does on
    GPUs; every position cost the tiny chat run a quarter of its step time), with the loss and gradients of the
    model's own loss over the full logits."""
    import trl.trainer.utils
    from trl.trainer.utils import add_fused_lm_head

    from hf_zero3.run.sft import score_trained_positions_only

    monkeypatch.setattr(trl.trainer.utils, "_use_triton", trl.trainer.utils._use_triton)  # TRL's own rule after

    tok = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False)
    batch = _packed_batch(tokenizer, [tok.chat(m) for m in conversations[:12]])
    model = _tiny_model("sdpa")
    own_loss, own_grads = _loss_and_grads(model, batch)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    score_trained_positions_only()
    fused_loss, fused_grads = _loss_and_grads(model, {**batch, "fused_lm_head": True})
    scored = model(**batch, fused_lm_head=True).log_probs.grad_fn
    assert type(scored).__name__ == "MaskedScatterBackward0"  # the trained positions' scores, put in place
    torch.testing.assert_close(fused_loss, own_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_grads, own_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_trl_without_the_lm_head_hook_trains_on_and_says_so_once(monkeypatch, capsys):
    """A later TRL without the private `_use_triton`: rank 0 says its LM head scores every position on CPU, and
    nothing is patched in."""
    import trl.trainer.utils

    from hf_zero3.run.sft import score_trained_positions_only

    monkeypatch.delattr(trl.trainer.utils, "_use_triton")
    score_trained_positions_only(main_process=False)
    assert capsys.readouterr().out == ""
    score_trained_positions_only()
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and "_use_triton" in said[0] and "scores every position" in said[0] and "CPU" in said[0]
    assert not hasattr(trl.trainer.utils, "_use_triton")


def test_packing_without_position_ids_would_cross_attend(tokenizer, conversations):
    """The check above can fail: the same packed row without position_ids (one long sequence) gives another loss."""
    tok = Tokenizer(tokenizer, tokenizer.chat_template, train_on_inputs=False)
    batch = _packed_batch(tokenizer, [tok.chat(m) for m in conversations[:6]])
    model = _tiny_model("sdpa")
    with torch.no_grad():
        apart = model(**batch).loss
        mixed = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        cached = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                       use_cache=True).loss  # a KV cache turns transformers' packed-sequence masks off
    assert abs(apart - mixed) > 1e-4 and abs(apart - cached) > 1e-4


def test_packing_is_refused_for_a_model_whose_mask_ignores_position_ids():
    from transformers import LlamaForCausalLM, MambaForCausalLM

    assert packing_problem(LlamaForCausalLM, "sdpa") is None
    assert packing_problem(LlamaForCausalLM, "flash_attention_2") is None
    problem = packing_problem(MambaForCausalLM, "eager")
    assert "MambaForCausalLM" in problem and "packing false" in problem


# -- datasets end to end -----------------------------------------------------------------------------------------------

def build(training_args, tokenizer, **kwargs):
    kwargs.setdefault("block_size", BLOCK)
    return build_datasets(DataArguments(**kwargs), tokenizer, training_args, MAX_POS)


def test_a_chat_file_becomes_examples_for_trl_to_pack(training_args, tokenizer):
    prepared = build(training_args, tokenizer, train_file=str(CHAT), validation_file=str(ASSETS / "chat" /
                                                                                         "validation.jsonl"))
    assert prepared.layout == PACKED and prepared.eval is not None
    assert set(prepared.train.column_names) == {"input_ids", "labels"}
    for ids, labels in zip(prepared.train["input_ids"][:50], prepared.train["labels"][:50]):
        assert len(ids) == len(labels) <= BLOCK and labels[0] == IGNORE  # packed, none predicts the one before
        assert ids[0] == tokenizer.bos_token_id  # each example starts with its BOS
    assert len(prepared.train) == sum(1 for _ in CHAT.read_text().splitlines())  # none dropped at 256 tokens
    assert prepared.tokens == sum(map(len, prepared.train["input_ids"]))


def test_padding_and_truncation_are_the_users_choice(training_args, tokenizer):
    padded = build(training_args, tokenizer, train_file=str(CHAT), packing=False, block_size=96)
    assert padded.layout == PADDED and "position_ids" not in padded.train.column_names
    assert max(len(x) for x in padded.train["input_ids"]) <= 96
    dropped = next(n for n in padded.notes if "dropped" in n)
    truncated = build(training_args, tokenizer, train_file=str(CHAT), packing=False, block_size=96,
                      overlong="truncate")
    assert "truncated" in " ".join(truncated.notes) and len(truncated.train) > len(padded.train)
    n_dropped = int(dropped.split("dropped ")[1].split(" of")[0])
    assert len(padded.train) == 3000 - n_dropped


def test_a_mix_takes_each_source_by_weight_or_count(training_args, tokenizer):
    by_count = build(training_args, tokenizer, packing=False, datasets=[
        {"path": str(CHAT), "examples": 100}, {"path": str(INSTRUCTIONS), "examples": 250}])
    bos = tokenizer.bos_token_id  # the chat template starts with it; the tiny tokenizer adds none to plain text
    assert len(by_count.train) == 350 and sum(ids[0] == bos for ids in by_count.train["input_ids"]) == 100
    by_weight = build(training_args, tokenizer, packing=False, datasets=[
        {"path": str(CHAT), "weight": 3.0}, {"path": str(INSTRUCTIONS), "weight": 1.0}])
    n_chat = sum(ids[0] == bos for ids in by_weight.train["input_ids"])
    assert len(by_weight.train) == 5000 and n_chat == 3750  # 3 : 1 of the 3000 + 2000 examples
    assert any("x its" in note for note in by_weight.notes)


def test_a_validation_split_comes_from_the_mixed_examples(training_args, tokenizer):
    prepared = build(training_args, tokenizer, packing=False, validation_split_percentage=10, datasets=[
        {"path": str(CHAT)}, {"path": str(INSTRUCTIONS)}])
    assert len(prepared.eval) == 500 and len(prepared.train) == 4500


def test_weights_and_a_validation_split_never_put_a_row_in_both(tmp_path, training_args, tokenizer):
    """Rows are held out before the weights repeat them: none of the held-out rows is trained on (each file's
    rows made unique, so a shared row could only come from the split)."""
    unique = []
    for path in (CHAT, INSTRUCTIONS):
        unique.append(tmp_path / path.name)
        unique[-1].write_text("".join(dict.fromkeys(line + "\n" for line in path.read_text().splitlines())))
    prepared = build(training_args, tokenizer, packing=False, validation_split_percentage=10, datasets=[
        {"path": str(unique[0]), "weight": 3.0}, {"path": str(unique[1]), "weight": 1.0}])
    trained = set(map(tuple, prepared.train["input_ids"]))
    assert len(prepared.eval) > 250 and not trained & set(map(tuple, prepared.eval["input_ids"]))


def test_chat_training_with_a_raw_text_validation_file_is_refused(tmp_path, training_args, tokenizer):
    """Its eval loss would be on raw text, which the run does not train; before the run and in the build alike."""
    values = {"train_file": str(CHAT), "validation_file": str(ASSETS / "corpus" / "validation.txt")}
    problems, _ = data_problems(values, None)
    assert problems and "validation_file" in problems[0] and "null" in problems[0] and "raw text" in problems[0]
    with pytest.raises(DataError, match="validation_file.*null"):
        build(training_args, tokenizer, **values)


def test_raw_text_alone_keeps_full_blocks(training_args, tokenizer):
    prepared = build(training_args, tokenizer, train_file=str(ASSETS / "corpus" / "validation.txt"), block_size=64)
    assert prepared.layout == BLOCKS and {len(x) for x in prepared.train["input_ids"]} == {64}


# -- bad data, before anything starts ----------------------------------------------------------------------------------

def problems_of(tmp_path, tokenizer_source=ASSETS / "model", **values):
    tok = AutoTokenizer.from_pretrained(tokenizer_source)
    found, _ = data_problems({"block_size": BLOCK, **values}, lambda: (tok, str(tokenizer_source)))
    return " ".join(found)


GOOD = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("rows, needles", [
    ([{"text": "no messages"}], ["no column 'messages'"]),
    ([{"messages": GOOD}, {"messages": [{"role": "bot", "content": "x"}]}], ["line 2", "role 'bot'", "system, developer"]),
    ([{"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}, GOOD[1]]}],
     ["line 1", "content parts of type image", "only text parts"]),
    ([{"messages": GOOD}, {"messages": []}], ["line 2", "empty conversation"]),
    ([{"messages": [GOOD[0]]}], ["no assistant turn", "train_on_inputs"]),
    ([{"messages": [{"role": "user"}, GOOD[1]]}], ["turn 0 (user) has no content"]),
])
def test_bad_chat_rows_are_named_before_the_run(tmp_path, rows, needles):
    message = problems_of(tmp_path, train_file=str(write_jsonl(tmp_path / "chat.jsonl", rows)), data_format="auto"
                          if "text" not in rows[0] else "chat")
    for needle in needles:
        assert needle in message, message


def test_blank_lines_do_not_shift_the_line_numbers(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": GOOD}) + "\n\n" + json.dumps({"messages": [GOOD[0]]}) + "\n")
    assert "line 3 has no assistant turn" in problems_of(tmp_path, train_file=str(path))


def test_a_template_that_cannot_render_a_role_is_found_on_a_sample(tmp_path):
    rows = [{"messages": GOOD}] * 3 + [{"messages": [*GOOD, {"role": "tool", "content": "42"}, GOOD[1]]}]
    user_assistant_only = ("{%- for m in messages %}{%- if m.role not in ['user', 'assistant'] %}"
                           "{{ raise_exception('unknown role ' ~ m.role) }}{%- endif %}<{{ m.role }}>{{ m.content }}"
                           "{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}")
    message = problems_of(tmp_path, train_file=str(write_jsonl(tmp_path / "c.jsonl", rows)),
                          chat_template=user_assistant_only)
    assert "row 4" in message and "cannot render" in message and "unknown role tool" in message


def test_a_tokenizer_without_a_chat_template_names_chat_template(tmp_path, tokenizer):
    bare = tmp_path / "bare"
    tokenizer.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink()
    path = str(write_jsonl(tmp_path / "c.jsonl", [{"messages": GOOD}]))
    assert "no chat template" in problems_of(tmp_path, bare, train_file=path)
    template = tmp_path / "t.jinja"
    template.write_text(LLAMA3_TEMPLATE)
    assert problems_of(tmp_path, bare, train_file=path, chat_template=str(template)) == ""


@pytest.mark.parametrize("name, content, needles", [
    ("bad.jsonl", b'{"messages": []}\n{"text": "a"\n', ["line 2 is not valid JSON"]),
    ("list.jsonl", b'{"text": "a"}\n[1, 2]\n', ["line 2 is a JSON list"]),
    ("binary.txt", bytes(range(256)) * 4, ["not text", "binary"]),
    ("latin1.txt", "caf\u00e9 au lait\nsecond\n".encode("latin-1"), ["not UTF-8", "line 1", "iconv"]),
    ("utf16.txt", "hello\n".encode("utf-16"), ["UTF-16", "iconv"]),
])
def test_unreadable_files_get_one_line_naming_the_fix(tmp_path, name, content, needles):
    path = tmp_path / name
    path.write_bytes(content)
    message = problems_of(tmp_path, train_file=str(path))
    for needle in needles:
        assert needle in message, message


def test_a_parquet_without_the_column_names_its_columns(tmp_path):
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_list([{"body": "x"}]).to_parquet(str(path))
    message = problems_of(tmp_path, train_file=str(path), data_format="chat")
    assert "no column 'messages'" in message and "['body']" in message and "messages_column" in message


def test_bad_mixture_entries_are_listed_together(tmp_path):
    message = problems_of(tmp_path, datasets=[{"path": str(CHAT), "wieght": 2}, {"name": "x", "path": "y"}, 5])
    assert "datasets[0].wieght" in message and "exactly one of path" in message and "datasets[2]" in message


def test_raw_text_of_short_documents_fills_blocks_longer_than_a_thousand_of_them(training_args, tokenizer, tmp_path):
    """Wrapped packing cuts blocks a map batch at a time, dropping each batch's remainder: with `datasets`' default
    batch of 1000 documents, 3,000 short ones gave one 16K block per batch, a block fewer than their tokens hold
    (and a block longer than a batch's tokens none at all: a 131072-token run was refused)."""
    corpus = tmp_path / "short.txt"
    corpus.write_text("".join(f"line {i} of many short documents.\n" for i in range(3000)))
    tokens = sum(len(x) + 1 for x in tokenizer(corpus.read_text().splitlines())["input_ids"])
    block = 16384
    prepared = build_datasets(DataArguments(train_file=str(corpus), block_size=block), tokenizer, training_args, block)
    assert len(prepared.train) == tokens // block >= 1, tokens
    assert {len(x) for x in prepared.train["input_ids"]} == {block}
