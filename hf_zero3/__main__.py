import sys

from hf_zero3.cli import main

sys.exit(main())
