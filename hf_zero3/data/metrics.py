"""Token accuracy at evaluation, counted where the loss is: the tokens whose label is not -100 (the responses of
chat and prompt/completion data, every token of raw text). The Trainer reports it as `eval_token_accuracy` beside
`eval_loss` (and the perplexity callback's `eval_perplexity`)."""

from __future__ import annotations

import numpy as np

from hf_zero3.data.tokenize import IGNORE


def predicted_tokens(logits, labels):
    """`preprocess_logits_for_metrics`: keep the argmax token, not the logits (vocab times smaller)."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def token_accuracy(eval_prediction) -> dict[str, float]:
    """`compute_metrics`: the share of trained positions whose next token the model predicted."""
    predictions, labels = np.asarray(eval_prediction.predictions), np.asarray(eval_prediction.label_ids)
    predicted, target = predictions[..., :-1], labels[..., 1:]
    counted = target != IGNORE
    total = int(counted.sum())
    return {"token_accuracy": float((predicted[counted] == target[counted]).sum() / total) if total else 0.0}
