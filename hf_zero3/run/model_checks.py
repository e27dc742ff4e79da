"""The model config's fields that its forward would trip on, checked before anything starts.

Why: transformers builds a model from almost any numbers; some only fail at the first forward, after the data is
tokenized and DeepSpeed has partitioned the weights (a router asked for more experts per token than there are:
`selected index k out of range`; query heads that key/value heads do not divide: a shape error in attention). One
table (`RULES`): a field a new model family trips on is one row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
"""The names families give their expert count (Mixtral, Qwen-MoE, DeepSeek)."""
POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "head_dim", "num_experts_per_tok", *EXPERT_COUNTS)


def _field(config, name: str) -> Any:
    return config.to_dict().get(name)


def _positive(config) -> list[str]:
    return [f"{name} is {value}: it counts rows of a weight or blocks of the model, set it to 1 or more"
            for name in POSITIVE if isinstance(value := _field(config, name), int) and not isinstance(value, bool)
            and value < 1]


def _experts(config) -> list[str]:
    chosen = _field(config, "num_experts_per_tok")
    named = next((n for n in EXPERT_COUNTS if isinstance(_field(config, n), int)), None)
    if not isinstance(chosen, int) or named is None or chosen <= _field(config, named):
        return []
    count = _field(config, named)
    return [(f"num_experts_per_tok is {chosen} but the model has {named} {count}: the router picks that many of "
             f"the {count} experts for each token (the first forward would fail: selected index out of range). Set "
             f"num_experts_per_tok to at most {count} (config_overrides: num_experts_per_tok={min(2, count)})")]


def _heads(config) -> list[str]:
    heads, kv = _field(config, "num_attention_heads"), _field(config, "num_key_value_heads")
    problems = []
    if isinstance(heads, int) and isinstance(kv, int) and heads >= 1 and kv >= 1 and heads % kv:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}: each key/value "
                        "head serves the same number of query heads (the first forward would fail on a shape). Set "
                        f"num_key_value_heads to a divisor of {heads}")
    hidden = _field(config, "hidden_size")
    if _field(config, "head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads >= 1 \
            and hidden % heads:
        problems.append(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and head_dim is not "
                        f"set: each head gets hidden_size / num_attention_heads dimensions. Set hidden_size to a "
                        f"multiple of {heads}, or head_dim")
    return problems


def _pad_token(config) -> list[str]:
    pad, vocab = _field(config, "pad_token_id"), _field(config, "vocab_size")
    if isinstance(pad, int) and isinstance(vocab, int) and vocab >= 1 and not -vocab <= pad < vocab:
        return [(f"pad_token_id {pad} is outside the vocabulary (vocab_size {vocab}): the embedding cannot hold it. "
                 f"Set pad_token_id below {vocab} (the tokenizer's pad token id), or raise vocab_size")]
    return []


RULES: tuple[Callable[[Any], list[str]], ...] = (_positive, _experts, _heads, _pad_token)


def problems(config, source: str) -> list[str]:
    """Each field of `config` (a transformers config) its model's forward would trip on, naming `source` and the
    fix."""
    found = _positive(config)
    if not found:  # the other rules divide and compare counts that must be positive
        found = [p for rule in RULES[1:] for p in rule(config)]
    return [f"model config of {source}: {p}" for p in found]
