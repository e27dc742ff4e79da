"""`hf_zero3.train` plus a callback that writes, per rank at the end of training, what the compiler did: which decoder
layers carry a compiled call, and dynamo's counters (graphs traced, frames, graph breaks) (launched like training:
`deepspeed --num_gpus 2 tests/integration/compile_probe.py PROBE_DIR CONFIG [overrides]`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.model.layers import checkpointing_layers
from hf_zero3.job.distributed import exit_process  # as hf_zero3.train ends: no abort in C++ teardown
from hf_zero3.model.regional_compile import is_compiled
from hf_zero3.train import main


class CompileProbe(TrainerCallback):
    def __init__(self, folder: Path):
        self.path = folder / f"rank{os.environ.get('RANK', '0')}.json"

    def on_train_end(self, args, state, control, model=None, **kwargs):
        from torch._dynamo.utils import counters

        self.path.write_text(json.dumps({
            "layers": [is_compiled(layer) for layer in checkpointing_layers(model)],
            "compiled_modules": sorted({type(m).__name__ for m in model.modules() if is_compiled(m)}),
            "counters": {key: dict(value) for key, value in counters.items()}}, default=str))


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = next(i for i, a in enumerate(argv) if not a.startswith("--local_rank"))  # the launcher prepends it
    folder = Path(argv.pop(at))
    folder.mkdir(parents=True, exist_ok=True)
    exit_process(main(argv, extra_callbacks=[CompileProbe(folder)]))
