"""The units every figure is reported in, each with one meaning, and the one size grammar.

Why one owner: `GB` meant 10^9 bytes in the planner and 1024^3 in the memory callback's `*_gb` log fields, 7%
apart under one name. Here a name says its unit: `GB` and fields ending `_gb` are 10^9 bytes (how GPU memory,
RAM and disks are sold, and the planner's tables); `GIB` and fields ending `_gib` are 2^30 (what torch, `free -g`
and `nvidia-smi` report). The size grammar raises ValueError, so every layer can use it; `hf_zero3.argtypes`
turns that into argparse's error for the command lines.
"""

from __future__ import annotations

import math
import re

GB = 10**9
"""Decimal gigabyte: the planner's unit, and fields named `*_gb`."""
GIB = 2**30
"""Binary gibibyte: torch's and the OS's unit, and fields named `*_gib`."""
_PREFIXES = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
SIZE_HELP = "give a number with a unit, e.g. 40GB (10^9 bytes), 80GiB or 512G (2^30 bytes)"


def gb(n: int | float) -> str:
    """Bytes as decimal GB, the unit GPU and RAM sizes are sold in."""
    return f"{n / GB:,.1f} GB"


def parse_size(text: str) -> int:
    """Bytes from '40GB' (decimal), '80GiB' (binary) or '512G' (binary, as in `free -g` and Slurm); ValueError
    naming the grammar otherwise."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(ib|b)?", str(text).strip().lower())
    if not match or (not match.group(2) and match.group(3) != "b"):
        raise ValueError(f"bad size {text!r}: {SIZE_HELP}")
    number, prefix, suffix = float(match.group(1)), match.group(2), match.group(3)
    base = 1000 if suffix == "b" else 1024
    return int(number * base ** _PREFIXES[prefix])


MAX_LOSS = 50.0
"""exp() of a larger loss overflows to inf, which JSON (train_log.jsonl, W&B, a model card's YAML) cannot hold."""


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(MAX_LOSS): the perplexity the logs and the model card report."""
    return math.exp(min(loss, MAX_LOSS))


GIB_FIELDS = ("gpu_allocated", "gpu_reserved", "gpu_peak_allocated", "gpu_peak_reserved", "pinned_host", "gpu_used",
              "host_rss", "host_peak_rss", "host_available")
"""The memory callback's figures, in GiB, logged as `<name>_gib`."""


def current_names(record: dict) -> dict:
    """A log record (train_log.jsonl, memory.jsonl, a bench or compare summary) under today's field names: logs
    written before the names said their unit called the same GiB figures `<name>_gb`."""
    old = {f"{name}_gb": f"{name}_gib" for name in GIB_FIELDS}
    return {old.get(key, key): value for key, value in record.items()}
