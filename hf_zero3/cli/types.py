"""Argument types shared by the verbs: each rejects a bad value at parse time, naming what to give instead."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def int_or_auto(text: str) -> int | str:
    """A whole number >= 1, or "auto" (the HF Trainer fills it)."""
    if text == "auto":
        return text
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}")
    return int(text)


def port(text: str) -> int:
    """A TCP port, 1..65535."""
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port 1..65535, got {text!r}")
    return int(text)


def output_file(text: str) -> str:
    """A file this verb will write: not a folder, and in a folder that exists (checked before any work is done)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file path, e.g. {path / 'ds_config.json'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.parent} does not exist: create it or choose "
                                         "another path")
    return text
