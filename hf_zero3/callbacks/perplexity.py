"""eval_perplexity next to every eval loss, in the Trainer's logs (so TensorBoard, W&B and every `report_to` get it)."""

from __future__ import annotations

import math

from transformers import TrainerCallback

from hf_zero3.callbacks._logs import merge_into_logs
from hf_zero3.units import perplexity


class PerplexityCallback(TrainerCallback):
    """Add `<prefix>_perplexity` for each `<prefix>_loss` of an evaluation record (`eval_loss`, or one per
    eval dataset, e.g. `eval_wiki_loss`).

    Why a callback and not a line after `trainer.evaluate()`: that line reached only the console and
    eval_results.json; evaluations during training and the `report_to` integrations never saw it. Installed
    before the integrations (`install_callbacks`), it adds the figure to the record they receive.
    """

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        values = {f"{key[:-len('_loss')]}_perplexity": perplexity(value) for key, value in logs.items()
                  if key.startswith("eval") and key.endswith("_loss") and isinstance(value, (int, float))
                  and math.isfinite(value)}
        if values:
            merge_into_logs(state, logs, values)
