"""TrainerCallbacks, one per file; usable alone with any `transformers.Trainer` (`trainer.add_callback`)."""

from hf_zero3.callbacks.jsonl_log import JsonlLogCallback


def default_callbacks(training_args) -> list:
    """The callbacks `hf-zero3 train` adds to every run (each may read the run's TrainingArguments)."""
    callbacks = [JsonlLogCallback()]
    return callbacks


__all__ = ["JsonlLogCallback", "default_callbacks"]
