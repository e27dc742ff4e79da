"""Stop a run whose loss or gradients stay non-finite, before it saves NaN weights as a complete checkpoint."""

from __future__ import annotations

import sys

from transformers import TrainerCallback

from hf_zero3.callbacks._console import say
from hf_zero3.callbacks._logs import merge_into_logs
from hf_zero3.checkpoint import lifecycle as ckpt


class NonFiniteError(RuntimeError):
    """Training went non-finite for too many steps in a row; the message names the last good checkpoint."""


class NonFiniteGuardCallback(TrainerCallback):
    """Stop training, naming the newest complete checkpoint, after `patience` non-finite optimizer steps in a row.

    Why: nothing in the stock stack stops a run that went NaN. The Trainer's `logging_nan_inf_filter` logs a
    running average instead of a NaN loss (so the log shows 0.0 or an old value), the run exits 0, and every save
    meanwhile marks NaN weights as a complete checkpoint and rotates a good one away.

    A step is non-finite when the training loss of any micro batch on any rank was NaN or inf (a forward hook on
    the model reads `output.loss`), or when the optimizer skipped the step in a run without fp16 loss scaling
    (an overflow: inf or NaN gradients). With fp16, skipped steps are the loss scaler's normal work: they are
    counted apart (`loss_scale_skips` in the logs) and never stop the run. No checkpoint is saved on a non-finite
    step. One 1-element all-reduce per step keeps all ranks' decisions identical, so all stop together.

    Args:
        patience: non-finite steps in a row that stop the run (0: never stop, only skip the saves).
    """

    def __init__(self, patience: int = 3):
        if patience < 0:
            raise ValueError(f"stop_after_nonfinite_steps must be >= 0 (0: never stop), got {patience}")
        self.patience = patience
        self.in_a_row = 0
        self.nonfinite_steps = 0
        self.loss_scale_skips = 0
        self._bad = None  # on-device flag: some micro batch of this step had a non-finite loss
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self._hook is None:
            self._hook = model.register_forward_hook(self._watch_loss)

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.in_a_row:  # the final save_model would write the non-finite weights as the model
            raise NonFiniteError(
                f"training ended on {self.in_a_row} non-finite step(s) (NaN/inf loss or gradients): the final model "
                f"was not saved. The newest complete checkpoint is {ckpt.newest_complete(args.output_dir)}")

    def _watch_loss(self, module, inputs, output) -> None:
        loss = getattr(output, "loss", None)
        if not module.training or loss is None:
            return
        import torch

        bad = ~torch.isfinite(loss.detach()).all()
        self._bad = bad if self._bad is None else self._bad | bad

    def _step_was_nonfinite(self, args, optimizer) -> tuple[bool, bool]:
        """(non-finite, fp16 loss-scale skip) for the step that just ended, agreed by every rank."""
        import torch
        import torch.distributed as dist

        skipped = bool(getattr(optimizer, "step_was_skipped", False))
        flag = torch.zeros((), device=self._bad.device if self._bad is not None else args.device)
        if self._bad is not None:
            flag = flag + self._bad.float()
        self._bad = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        loss_bad = bool(flag.item())
        scaled = bool(args.fp16)
        return loss_bad or (skipped and not scaled), skipped and scaled and not loss_bad

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        bad, scale_skip = self._step_was_nonfinite(args, optimizer)
        self.loss_scale_skips += scale_skip
        if not bad:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.nonfinite_steps += 1
        newest = ckpt.newest_complete(args.output_dir)
        if control.should_save:
            control.should_save = False
            if state.is_world_process_zero:
                say(f"hf_zero3: step {state.global_step} is non-finite (NaN/inf loss or gradients): not saving "
                    f"checkpoint-{state.global_step}", file=sys.stderr)
        if self.patience and self.in_a_row >= self.patience:
            raise NonFiniteError(
                f"the loss or the gradients were NaN/inf for {self.in_a_row} steps in a row (steps "
                f"{state.global_step - self.in_a_row + 1}-{state.global_step}); training stopped. The newest complete "
                f"checkpoint is {newest or 'none (no complete checkpoint in output_dir)'}. Lower the learning rate "
                "(or raise warmup), check the data and the checkpoint you resumed from, then resume with "
                + (f"--resume_from_checkpoint {newest}" if newest else "a fresh output_dir"))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and (self.nonfinite_steps or self.loss_scale_skips):
            merge_into_logs(state, logs, {"nonfinite_steps": self.nonfinite_steps,
                                          "loss_scale_skips": self.loss_scale_skips})
