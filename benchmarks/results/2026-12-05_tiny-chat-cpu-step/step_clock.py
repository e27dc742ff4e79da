"""`python step_clock.py TRAIN_ARGS...`: hf_zero3's train (of whichever checkout PYTHONPATH names) with a callback
that records each optimizer step's wall time and this process's CPU time, written to OUTPUT_DIR.steps.json."""

import json
import sys
import time

from transformers import TrainerCallback

from hf_zero3.run.train import main


class StepClock(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append((time.perf_counter() - self.wall, time.process_time() - self.cpu))


if __name__ == "__main__":
    clock = StepClock()
    rc = main(sys.argv[1:], extra_callbacks=[clock])
    with open(sys.argv[sys.argv.index("--output_dir") + 1] + ".steps.json", "w") as f:
        json.dump(clock.rows, f)
    sys.exit(rc)
