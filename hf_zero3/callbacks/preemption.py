"""Stop on a scheduler's warning signal at the end of the step in flight, with a complete checkpoint of that step."""

from __future__ import annotations

import signal
import time

from transformers import TrainerCallback

from hf_zero3.callbacks._console import say
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.job.preemption import DEFAULT_SIGNALS, PREEMPTED_EXIT, parse_signals


class Preempted(RuntimeError):
    """Training stopped on a preemption signal; the message names the checkpoint and the command that continues."""

    exit_code = PREEMPTED_EXIT


class PreemptionCallback(TrainerCallback):
    """On any of `signals`, every rank finishes the optimizer step in flight, the Trainer saves `checkpoint-N`
    through its own save (so `CheckpointGuardCallback` verifies and marks it), and training stops.

    Why: SLURM (`--signal`, a time limit, preemption), Kubernetes and spot VMs send SIGTERM or SIGUSR1 some seconds
    to minutes before they kill a job; by default the signal kills every rank and everything since the last periodic
    checkpoint is lost. A signal reaches the ranks at different moments (or only some of them), so the ranks agree
    at each step's end: one 1-element all-reduce (MAX) of "a signal came", and all stop after the same step. The
    evaluation due at that step is skipped (the time is the scheduler's). A signal before the first step stops the
    run after it; one after the last step changes nothing (the run finishes and saves its final model).

    The handlers are installed when the callback is made (`hf-zero3 train` makes it before loading the model) and
    stay until `release()`: a signal during the final save does not kill it. A signal that came earlier is not lost:
    `hf-zero3 launch` starts the ranks with the signals blocked, and the callback unblocks them once its handler is
    in place (the launcher then exits 75 for a signal that came as the run finished).

    Args:
        signals: comma-separated signal names (`hf_zero3.job.preemption.parse_signals`).
    """

    def __init__(self, signals: str | None = DEFAULT_SIGNALS):
        self.signals = parse_signals(signals)
        self.caught: signal.Signals | None = None
        self.caught_at: float | None = None
        self.stopped_at: int | None = None
        """The step after which training stopped; None while it runs (or when it ran to its end)."""
        self.saved_s: float | None = None
        self._save_started = 0.0
        self._previous = {sig: signal.signal(sig, self._catch) for sig in self.signals}
        # `hf-zero3 launch` starts the ranks with these signals blocked, so that one sent before now is held, not
        # lost: it arrives here, with the handler in place
        self._blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals) & set(self.signals)
        _listening.append(self)

    def _catch(self, signum, frame) -> None:
        # Only a note: the main thread may be anywhere (inside a print, a save); the step's end acts on it.
        if self.caught is None:
            self.caught, self.caught_at = signal.Signals(signum), time.monotonic()

    def release(self) -> None:
        """Put the signal handlers back as they were."""
        if self._blocked:  # a signal from now on waits, pending, until the process ends (as it came)
            signal.pthread_sigmask(signal.SIG_BLOCK, self._blocked)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous, self._blocked = {}, set()

    def _agreed(self, args) -> signal.Signals | None:
        """The signal that any rank caught, the same answer on every rank."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor(float(self.caught or 0), device=args.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        number = int(flag.item())
        return signal.Signals(number) if number else None

    def on_step_end(self, args, state, control, **kwargs):
        if not self.signals or self.stopped_at is not None:
            return
        caught = self._agreed(args)
        if caught is None:
            return
        self.stopped_at = state.global_step
        control.should_save, control.should_evaluate, control.should_training_stop = True, False, True
        self._save_started = time.monotonic()
        if state.is_world_process_zero:
            say(f"hf_zero3: {caught.name} received: stopping after step {state.global_step}, saving "
                f"{ckpt.checkpoint_dir(args.output_dir, state.global_step)}")

    def on_save(self, args, state, control, **kwargs):
        if self.stopped_at is not None and self.saved_s is None:
            self.saved_s = time.monotonic() - self._save_started

    def outcome(self, output_dir: str) -> Preempted:
        """What to tell the user once training stopped: the checkpoint (complete or why not) and how to go on."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # rank 0 marks the checkpoint complete after the others are done with it; a rank that exited before
            # would have the launcher (DeepSpeed's, srun --kill-on-bad-exit) kill rank 0 while it writes the marker
            dist.barrier()
        folder = ckpt.checkpoint_dir(output_dir, self.stopped_at)
        newest = ckpt.newest_complete(output_dir)
        since = f" ({time.monotonic() - self.caught_at:.0f} s after the signal)" if self.caught_at else ""
        if newest is not None and newest == folder:
            done = f"{folder} is complete (saved in {self.saved_s or 0:.0f} s){since}"
        else:
            done = (f"{folder} was not saved (a non-finite step saves nothing); the newest complete checkpoint is "
                    f"{newest or 'none'}")
        return Preempted(f"preempted: training stopped after step {self.stopped_at} on a preemption signal; {done}. "
                         f"The same command with --resume_from_checkpoint auto continues from there "
                         f"(exit code {PREEMPTED_EXIT})")


_listening: list[PreemptionCallback] = []


def release_all() -> None:
    """Every PreemptionCallback's handlers back as they were (the end of `hf-zero3 train`; in-process runs)."""
    while _listening:
        _listening.pop().release()
