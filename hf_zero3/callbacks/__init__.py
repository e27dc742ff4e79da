"""TrainerCallbacks, one per file; usable alone with any `transformers.Trainer` (`trainer.add_callback`)."""

from hf_zero3.callbacks.adapter_check import AdapterCheckCallback
from hf_zero3.callbacks.checkpoint_guard import CheckpointGuardCallback
from hf_zero3.callbacks.deepspeed_timers import DeepSpeedTimersCallback
from hf_zero3.callbacks.hub_push import HubPushCallback
from hf_zero3.callbacks.jsonl_log import JsonlLogCallback
from hf_zero3.callbacks.memory import MemoryCallback
from hf_zero3.callbacks.nonfinite_guard import NonFiniteError, NonFiniteGuardCallback
from hf_zero3.callbacks.nvme_resume import NvmeResumeCallback
from hf_zero3.callbacks.partial_checkpointing import PartialCheckpointingCallback
from hf_zero3.callbacks.perplexity import PerplexityCallback
from hf_zero3.callbacks.throughput import ThroughputCallback


def default_callbacks(training_args, seq_len: int | None = None, sources: dict | None = None,
                      tokens_per_sample: float | None = None, lora: bool = False) -> list:
    """The callbacks `hf-zero3 train` adds to every run (each may read the run's TrainingArguments).
    `sources` (base_model, datasets) go into each checkpoint's marker, for the model card; `seq_len` and
    `tokens_per_sample` are the throughput callback's (see there); `lora`: the model trains a peft adapter.

    Order matters: the ones that add fields to the logs come before JsonlLogCallback, which writes them.
    """
    callbacks = [MemoryCallback(), PerplexityCallback()]
    if seq_len:
        callbacks.append(ThroughputCallback(seq_len=seq_len, peak_tflops=getattr(training_args, "peak_tflops", None),
                                            tokens_per_sample=tokens_per_sample))
    callbacks.append(NonFiniteGuardCallback(patience=getattr(training_args, "stop_after_nonfinite_steps", 3)))
    callbacks.append(JsonlLogCallback())  # after the guard above: it adds its counts to the logs
    if lora:  # before the guard: a save whose adapter is not the trained one gets no completion marker
        callbacks.append(AdapterCheckCallback())
    callbacks.append(CheckpointGuardCallback(save_total_limit=training_args.save_total_limit, sources=sources))
    if training_args.push_to_hub:  # after the guard: pushes only checkpoints it marked complete
        callbacks.append(HubPushCallback(training_args.hub_model_id, private=bool(training_args.hub_private_repo),
                                         revision=training_args.hub_revision))
    return callbacks


def install_callbacks(trainer, callbacks: list) -> None:
    """Put `callbacks` after the Trainer's flow and console printers but before the `report_to`
    integrations, so that TensorBoard & co. receive the fields our callbacks add to each log record,
    while the console line stays the stock one."""
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback

    handler = trainer.callback_handler
    first = [cb for cb in handler.callbacks if isinstance(cb, (DefaultFlowCallback, PrinterCallback,
                                                               ProgressCallback))]
    rest = [cb for cb in handler.callbacks if cb not in first]
    handler.callbacks = first + list(callbacks) + rest


__all__ = ["AdapterCheckCallback", "CheckpointGuardCallback", "DeepSpeedTimersCallback", "HubPushCallback", "JsonlLogCallback",
           "MemoryCallback", "NonFiniteError",
           "NonFiniteGuardCallback", "NvmeResumeCallback", "PartialCheckpointingCallback", "PerplexityCallback", "ThroughputCallback", "default_callbacks",
           "install_callbacks"]
