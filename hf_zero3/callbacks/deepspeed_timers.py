"""DeepSpeed's wall-clock breakdown (forward/backward/all-reduce/step) into the Trainer's logs, and
DeepSpeed's own log lines into a per-run file: the seed's `zero_stage3.log`, kept, not just printed."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.callbacks._logs import merge_into_logs

GLOBAL_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
"""DeepSpeed's per-optimizer-step timers (ZeRO-3 all-gathers run inside fwd/bwd through prefetching)."""


class DeepSpeedTimersCallback(TrainerCallback):
    """Mean DeepSpeed timer values per optimizer step since the last log, as `ds_<timer>_ms` log fields,
    and DeepSpeed's logger written to `<output_dir>/deepspeed_rank<R>.log`.

    Needs the trainer (the DeepSpeed engine is `trainer.model_wrapped`, which callbacks are not given);
    the timers exist only with `"wall_clock_breakdown": true` in the ds_config, else the fields are absent.

    Args:
        trainer: the `transformers.Trainer` this callback is added to.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self._sums: dict[str, float] = {}
        self._steps = 0
        self._handler: logging.Handler | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if not args.deepspeed:
            return
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        path = Path(args.output_dir) / f"deepspeed_rank{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = logging.FileHandler(path)
        self._handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
        logging.getLogger("DeepSpeed").addHandler(self._handler)

    def on_train_end(self, args, state, control, **kwargs):
        if self._handler is not None:
            logging.getLogger("DeepSpeed").removeHandler(self._handler)
            self._handler.close()
            self._handler = None

    def on_step_end(self, args, state, control, **kwargs):
        engine = getattr(self.trainer, "model_wrapped", None)
        timers = getattr(engine, "get_wall_clock_timers", lambda: {})() or {}
        found = {name: timers[name] for name in GLOBAL_TIMERS if name in timers}
        if found:
            for name, ms in found.items():
                self._sums[name] = self._sums.get(name, 0.0) + ms
            self._steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not self._steps:
            return
        merge_into_logs(state, logs, {f"ds_{name}_ms": round(total / self._steps, 3)
                                      for name, total in self._sums.items()})
        self._sums, self._steps = {}, 0
