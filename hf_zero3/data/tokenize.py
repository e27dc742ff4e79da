"""Examples as token ids and labels, -100 where the model should not learn.

Chat is rendered by the tokenizer's own chat template (`apply_chat_template`). The loss mask comes from the
rendered conversation, never from searching its text: a template with `{% generation %}` markers (or TRL's training
version of a known template) gives it through `return_assistant_tokens_mask`; for any other template each assistant
turn's characters are found by rendering the conversation up to that turn (with and without the generation prompt)
and every token overlapping them is trained, the rule transformers applies to its generation spans. A template that
renders earlier turns differently once later ones follow (some drop past reasoning) trains one example per turn.
Prompt/completion follows TRL: the completion starts where the tokenized prompt and prompt + completion diverge.

Every example's first label is -100: no token predicts it, and packed examples then never predict each other.
"""

from __future__ import annotations

import copy
import os

from hf_zero3.data.errors import DataError
from hf_zero3.data.formats import as_messages

IGNORE = -100
"""The label the loss skips (PyTorch's cross-entropy ignore_index, the Trainer's convention)."""

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")
"""Tokens that end an assistant's turn in today's templates; the model must be trained on them to learn to stop."""

_PROBE = "\ufffc"
"""Put before an assistant turn's content to find where the rendering of that content starts."""


def chat_template_of(tokenizer, chat_template: str | None, tokenizer_name: str) -> str:
    """The template to render with: the user's (a .jinja file or the template text), else the tokenizer's own."""
    if chat_template:
        if os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                return f.read()
        if "{{" in chat_template or "{%" in chat_template:
            return chat_template
        raise DataError(f"chat_template {chat_template!r} is neither a file nor a Jinja template: point it at a "
                        f".jinja file (resolved from the current directory {os.getcwd()!r}) or give the template text.")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise DataError(f"the tokenizer of {tokenizer_name} has no chat template, so chat data cannot be rendered: "
                        "set chat_template to a .jinja file (the template of the model family you fine-tune, e.g. "
                        "from its tokenizer_config.json or chat_template.jinja), or use a tokenizer that has one.")
    return template


class Tokenizer:
    """One tokenizer and chat template, turning rows of each format into {input_ids, labels}."""

    def __init__(self, tokenizer, template: str | None, *, train_on_inputs: bool, use_markers: bool | None = None):
        from trl.chat_template_utils import has_generation_markers  # TRL takes seconds: only for chat data

        self.tok, self.template, self.train_on_inputs = tokenizer, template, train_on_inputs
        self.from_trl = False
        """The template is TRL's training version of the one given (ChatML/Qwen2.5, Llama 3 and 3.1, Qwen3, Gemma,
        Phi, DeepSeek, ...: `get_training_chat_template` adds the markers to a known template without them)."""
        if use_markers is None and template and not has_generation_markers(template) and not train_on_inputs:
            if trained := _training_template(tokenizer, template):
                self.template, self.from_trl = trained, True
        self.use_markers = bool(self.template) and has_generation_markers(self.template) if use_markers is None \
            else use_markers
        self.eos = tokenizer.eos_token_id
        vocab = tokenizer.get_vocab()
        self.stops = {self.eos} | {vocab[t] for t in END_OF_TURN if t in vocab}
        self.end_of_turn_outside: str | None = None
        """The end-of-turn token the template's markers leave out (trained with the turn), once one was found."""

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def _ids(self, text: str, offsets: bool = False):
        return self.tok(text, add_special_tokens=False, return_offsets_mapping=offsets)

    def _messages(self, turns: list) -> list[dict]:
        """`as_messages`, with a developer turn rendered as a system turn by a template that does not know the role."""
        messages = as_messages(turns)
        if self.template and "developer" not in self.template:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        return messages

    def chat_examples(self, turns: list, tools=None) -> list[dict]:
        """The conversation as one example; where the template renders earlier turns differently once later ones
        follow (some drop past reasoning), one example per assistant turn, each rendered as the template renders
        that turn's context at inference, only that turn trained."""
        try:
            return [self.chat(turns, tools)]
        except NotPrefixError:
            messages = self._messages(turns)
            return [self._masked(self.render(messages[: i + 1], tools), [self._span(messages[: i + 1], i, tools)])
                    for i, m in enumerate(messages) if m["role"] == "assistant"]

    def _span(self, messages: list[dict], i: int, tools) -> tuple[int, int]:
        """The characters of assistant turn `i` in the rendering of `messages` up to it."""
        through = self.render(messages[: i + 1], tools)
        if i:
            before = self.render(messages[:i], tools, add_generation_prompt=True)
        else:  # the preamble a template puts first (a default system prompt, a date) is not the assistant's
            probe = {**messages[i], "content": _PROBE + (messages[i].get("content") or "")}
            before = through[:_common_prefix(self.render([probe], tools), through)]
        if not through.startswith(before):
            raise NotPrefixError(f"turn {i} renders differently once later turns follow")
        return len(before), max(len(before), len(through.rstrip()))

    def chat(self, turns: list, tools=None) -> dict:
        messages = self._messages(turns)
        if self.train_on_inputs:
            ids = self._ids(self.render(messages, tools))["input_ids"]
            return _example(ids, ids)
        if self.use_markers:
            out = self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=True,
                                               return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
            self._train_end_of_turn(ids, mask)
            return _example(ids, [t if m else IGNORE for t, m in zip(ids, mask)])
        text = self.render(messages, tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                spans.append(self._span(messages, i, tools))
                if not text.startswith(self.render(messages[: i + 1], tools)):
                    raise NotPrefixError(f"turn {i} renders differently once later turns follow")
        return self._masked(text, spans)

    def _train_end_of_turn(self, ids: list[int], mask: list[int]) -> None:
        """An end-of-turn token right after a marked span is trained with it: a template whose markers leave it out
        would never teach the model to stop. The first one found is remembered, for the run to say so."""
        for j in range(1, len(ids)):
            if mask[j - 1] and not mask[j] and ids[j] in self.stops:
                mask[j] = 1
                self.end_of_turn_outside = self.end_of_turn_outside or self.tok.convert_ids_to_tokens(ids[j])

    def _masked(self, text: str, spans: list[tuple[int, int]]) -> dict:
        """Token ids of `text`, labelled where a token overlaps one of the character spans."""
        enc = self._ids(text, offsets=True)
        ids, labels, k = list(enc["input_ids"]), [], 0
        for token, (start, end) in zip(ids, enc["offset_mapping"]):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            labels.append(token if k < len(spans) and end > spans[k][0] else IGNORE)
        return _example(ids, labels)

    def prompt_completion(self, prompt, completion, tools=None) -> dict:
        if isinstance(prompt, str):
            ids = self.tok(prompt + completion)["input_ids"]
            if self.eos is not None and (not ids or ids[-1] != self.eos):
                ids = ids + [self.eos]
            prompt_ids = self.tok(prompt)["input_ids"]
        else:
            if not self.template:
                raise DataError("prompt and completion hold conversations, but the tokenizer has no chat template to "
                                "render them: set chat_template to a .jinja file, or give prompt and completion as "
                                "text.")
            prompt, completion = self._messages(prompt), self._messages(completion)
            ids = self._ids(self.render(prompt + completion, tools))["input_ids"]
            prompt_ids = self._ids(self.render(prompt, tools, add_generation_prompt=True))["input_ids"]
        if self.train_on_inputs:
            return _example(ids, ids)
        n = _common_prefix(prompt_ids, ids)
        return _example(ids, [IGNORE] * n + ids[n:])

    def document(self, text: str, block_size: int) -> list[dict]:
        """Raw text as examples of at most `block_size` tokens (a long document is cut, not dropped), EOS-ended."""
        ids = self.tok(text)["input_ids"]
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids = ids + [self.eos]
        return [_example(ids[i:i + block_size], ids[i:i + block_size]) for i in range(0, len(ids), block_size)]


class NotPrefixError(DataError):
    """The chat template renders a conversation's earlier turns differently once later turns follow
    (`Tokenizer.chat_examples` then trains one example per assistant turn)."""


def _training_template(tokenizer, template: str) -> str | None:
    """TRL's training version of `template`; None when TRL knows none."""
    from trl.chat_template_utils import get_training_chat_template

    probe = copy.copy(tokenizer)
    probe.chat_template = template
    try:
        return get_training_chat_template(probe)
    except ValueError:  # a template TRL has no training version of
        return None


def _common_prefix(a, b) -> int:
    """How many leading items (tokens, or characters) two sequences share."""
    return len(os.path.commonprefix([a, b]))


def _example(ids: list[int], labels: list[int]) -> dict:
    labels = list(labels)
    if labels:
        labels[0] = IGNORE
    return {"input_ids": list(ids), "labels": labels}
