"""One line to the console while a tqdm bar may be drawn (the Trainer's progress bar, a bench's)."""

from __future__ import annotations

import sys


def say(line: str, file=None) -> None:
    """Print `line` (on stdout, or `file`) through tqdm.write: a bar on the terminal is cleared first and drawn
    again after, so neither the line nor the bar is cut; off a terminal it is a plain line."""
    from tqdm.auto import tqdm

    file = file or sys.stdout
    tqdm.write(line, file=file)
    file.flush()
