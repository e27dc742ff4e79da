"""Argument types for the command lines: what every verb and the launcher accept.

Why one owner: three positive-int types that disagreed (one accepted "+3", one crashed on "abc"), and a second
size regex in the launcher's `--target` whose grammar differed from `plan --gpu-mem`. The size grammar itself is
`hf_zero3.units.parse_size` (a ValueError, for every layer); here it raises argparse's error, which argparse
prints as it is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_zero3 import units


def parse_size(text: str) -> int:
    """`units.parse_size` as an argparse type."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    """A whole number >= 1, written as digits."""
    if not str(text).strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    """A finite number > 0, e.g. a GPU's peak TFLOP/s."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def int_or_auto(text: str) -> int | str:
    """A positive integer, or "auto" (the HF bridge fills it from TrainingArguments)."""
    if text == "auto":
        return text
    if not str(text).strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}")
    return int(text)


def port(text: str) -> int:
    """A TCP port, 1..65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port 1..65535, got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file a verb will write: not a folder, and in a folder that exists (checked before any work is done)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file path, e.g. {path / 'ds_config.json'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist: create it or choose "
                                         "another path")
    return text
