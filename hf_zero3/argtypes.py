"""Argument types and the one size grammar: what every verb, the launcher's environment and export accept.

Why one owner: three positive-int types that disagreed (one accepted "+3", one crashed on "abc"), and a second
size regex in the launcher's `--target` whose grammar differed from `plan --gpu-mem`.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes from '40GB' (decimal), '80GiB' (binary) or '512G' (binary, as in `free -g` and Slurm)."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(ib|b)?", str(text).strip().lower())
    if not match or (not match.group(2) and match.group(3) != "b"):
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: give a number with a unit, e.g. 40GB (10^9 bytes), 80GiB or 512G (2^30 bytes)")
    number, prefix, suffix = float(match.group(1)), match.group(2), match.group(3)
    base = 1000 if suffix == "b" else 1024
    return int(number * base ** _UNITS[prefix])


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
