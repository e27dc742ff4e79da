"""`python -m hf_zero3.train`: the module launchers start (torchrun -m, accelerate launch -m, deepspeed --module).

The run itself is `hf_zero3.run.train`; `hf-zero3 train` is the same.
"""

import sys

from hf_zero3.run.train import main

if __name__ == "__main__":
    sys.exit(main())
