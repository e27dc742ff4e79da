"""`hf_zero3.train` plus a callback that writes, per rank after the first step, what ZeRO-3 keeps of each parameter:
persistent or not, the elements of its whole data and of its partition (launched like training:
`deepspeed --num_gpus 2 tests/integration/persistence_probe.py PROBE_DIR CONFIG [overrides]`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.job.distributed import exit_process  # as hf_zero3.train ends: no abort in C++ teardown
from hf_zero3.train import main


class PersistenceProbe(TrainerCallback):
    def __init__(self, folder: Path):
        self.path = folder / f"rank{os.environ.get('RANK', '0')}.json"

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.path.exists():
            self.path.write_text(json.dumps([
                {"name": name, "persist": bool(p.ds_persist), "numel": p.ds_numel, "whole": p.data.numel(),
                 "partition": p.ds_tensor.numel()} for name, p in model.named_parameters()]))


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = next(i for i, a in enumerate(argv) if not a.startswith("--local_rank"))  # the launcher prepends it
    folder = Path(argv.pop(at))
    folder.mkdir(parents=True, exist_ok=True)
    exit_process(main(argv, extra_callbacks=[PersistenceProbe(folder)]))
