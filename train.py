"""The seed's `deepspeed ... train.py --deepspeed ds_config.json`: runs `hf-zero3 train` (hf_zero3/train.py)."""
from hf_zero3.job.distributed import exit_process
from hf_zero3.run.train import main

if __name__ == "__main__":
    exit_process(main())  # a finished run exits with its code, not a teardown abort (see exit_process)
