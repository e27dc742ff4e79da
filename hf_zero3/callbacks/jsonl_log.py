"""Every Trainer log record, one JSON line each, in `<output_dir>/train_log.jsonl`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback


class JsonlLogCallback(TrainerCallback):
    """Append each `on_log` record (loss, lr, eval metrics, ...) with its step to a JSONL file.

    Why: trainer_state.json is only written at checkpoints; a JSONL that grows every logging step can be
    tailed, plotted or parsed while the run goes on, and survives a crash.

    Args:
        filename: file name inside `args.output_dir`.
    """

    def __init__(self, filename: str = "train_log.jsonl"):
        self.filename = filename

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        path = Path(args.output_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, "epoch": state.epoch, "time": time.time(), **logs}
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
