"""`hf_zero3.train` plus a callback that records, per rank and step, what activation offload stashed in host memory
(launched like training: `deepspeed --num_gpus 2 tests/integration/offload_probe.py PROBE_DIR CONFIG [overrides]`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.model.activation_offload import decoder_of
from hf_zero3.job.distributed import exit_process  # as hf_zero3.train ends: no abort in C++ teardown
from hf_zero3.train import main


def _offloader(model):
    return getattr(decoder_of(getattr(model, "module", model)), "_hf_zero3_offloader", None)


class OffloadProbe(TrainerCallback):
    """Appends the offloader's stats after every optimizer step (none found: the line says so)."""

    def __init__(self, folder: Path):
        self.path = folder / f"rank{os.environ.get('RANK', '0')}.jsonl"

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        offloader = _offloader(model)
        if offloader is not None:
            offloader.reset_peak()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        offloader = _offloader(model)
        stats = vars(offloader.stats) if offloader is not None else {"offloader": None}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": state.global_step, **stats}) + "\n")


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = next(i for i, a in enumerate(argv) if not a.startswith("--local_rank"))  # the launcher prepends it
    folder = Path(argv.pop(at))
    folder.mkdir(parents=True, exist_ok=True)
    exit_process(main(argv, extra_callbacks=[OffloadProbe(folder)]))
