"""Batches for the Trainer, and the check that packed examples stay apart.

Packed blocks carry `position_ids` that restart at 0 for every example. transformers turns those into attention
that never crosses an example: flash-attention kernels run varlen over the micro batch flattened into one row
(what `DataCollatorWithFlattening` does, here with the sequence boundaries precomputed); SDPA, eager and flex
attention get a block-diagonal causal mask from `masking_utils`, built from the same position_ids when no
attention_mask is given and no KV cache is in use (so every packed batch says `use_cache: False`: a model whose
config leaves the cache on would otherwise build one in training and attend across examples). A model that builds
its mask another way (or keeps a recurrent state) would mix the
examples of a block: `packing_problem` finds that before training starts."""

from __future__ import annotations

import sys

import torch

from hf_zero3.data.tokenize import IGNORE

MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")
"""transformers.masking_utils functions that honour packed position_ids."""


def attention_of(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def flattens(attention: str) -> bool:
    """Whether this attention kernel takes a micro batch flattened into one row (flash-attention varlen)."""
    return "flash" in attention


def packing_problem(model_class: type, attention: str) -> str | None:
    """Why packing would let one example attend to another in a model of this class with this attention kernel
    (None: it would not)."""
    if flattens(attention):
        return None
    module = sys.modules.get(model_class.__module__)
    if module is not None and any(hasattr(module, name) for name in MASK_BUILDERS):
        return None
    return (f"packing puts several examples in one block, and {model_class.__name__} ({attention} attention) does "
            "not build its attention mask from position_ids, so they would attend to each other (or share a "
            "recurrent state): set packing false (one example per row, padded)")


def _as_tensor(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


class PackedCollator:
    """Packed blocks -> a batch: flattened into one row for flash attention, else padded to the longest block
    (padding is its own "example": label -100, positions from 0, attended by nothing real)."""

    def __init__(self, pad_token_id: int, flatten: bool, pad_to_multiple_of: int | None = None):
        self.pad, self.flatten, self.multiple = pad_token_id, flatten, pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict:
        if self.flatten:
            positions = [p for f in features for p in f["position_ids"]]
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
            lengths = [b - a for a, b in zip(starts, starts[1:])]
            cu = torch.tensor(starts, dtype=torch.int32)
            return {"input_ids": _as_tensor([[t for f in features for t in f["input_ids"]]]),
                    "labels": _as_tensor([[t for f in features for t in f["labels"]]]),
                    "position_ids": _as_tensor([positions]),
                    "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
                    "max_length_k": max(lengths), "use_cache": False}
        width = _padded_width(max(len(f["input_ids"]) for f in features), self.multiple)
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for f in features:
            pad = width - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE] * pad)
            batch["position_ids"].append(list(f["position_ids"]) + list(range(pad)))
        return {**{k: _as_tensor(v) for k, v in batch.items()}, "use_cache": False}


class PaddedCollator:
    """One example per row, right-padded to the longest in the batch, with an attention_mask."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad, self.multiple = pad_token_id, pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict:
        width = _padded_width(max(len(f["input_ids"]) for f in features), self.multiple)
        batch = {"input_ids": [], "labels": [], "attention_mask": []}
        for f in features:
            n, pad = len(f["input_ids"]), width - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE] * pad)
            batch["attention_mask"].append([1] * n + [0] * pad)
        return {k: _as_tensor(v) for k, v in batch.items()}


def _padded_width(longest: int, multiple: int | None) -> int:
    return longest if not multiple else -(-longest // multiple) * multiple
