"""`python -m hf_zero3.train`: the module launchers start (torchrun -m, accelerate launch -m, deepspeed --module).

The run itself is `hf_zero3.run.train`; `hf-zero3 train` is the same.
"""

from hf_zero3.job.distributed import exit_process
from hf_zero3.run.train import main

if __name__ == "__main__":
    exit_process(main())  # a finished run exits with its code, not a teardown abort (see exit_process)
