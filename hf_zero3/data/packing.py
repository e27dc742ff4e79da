"""Blocks of at most `block_size` tokens.

Raw text is joined with EOS and cut into full blocks (pre-training style: documents run into each other, and no
token is padding). Chat and prompt/completion examples are packed whole, best-fit decreasing, and each keeps its own
`position_ids` from 0, which is what lets attention keep examples apart (`hf_zero3.data.collate`)."""

from __future__ import annotations

import bisect
from itertools import chain


def text_blocks(batch: dict, block_size: int) -> dict:
    """`datasets.map` function: token streams joined and cut into full blocks; the remainder is dropped."""
    flat = list(chain.from_iterable(batch["input_ids"]))
    n = len(flat) // block_size * block_size
    blocks = [flat[i: i + block_size] for i in range(0, n, block_size)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks]}


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total <= capacity: longest first, each into the fullest bin it fits.
    Deterministic. Every length must be <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free_sizes: list[int] = []           # the distinct free capacities of open bins, sorted
    by_free: dict[int, list[int]] = {}   # free capacity -> open bins with exactly that much room
    for i in order:
        size = lengths[i]
        k = bisect.bisect_left(free_sizes, size)
        if k < len(free_sizes):
            free = free_sizes[k]
            b = by_free[free].pop()
            if not by_free[free]:
                del by_free[free]
                free_sizes.pop(k)
        else:
            b, free = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        left = free - size
        if left > 0:
            if left not in by_free:
                bisect.insort(free_sizes, left)
                by_free[left] = []
            by_free[left].append(b)
    return bins


def pack_examples(batch: dict, block_size: int) -> dict:
    """`datasets.map` function: examples packed into blocks; labels as they are (each example's first is -100),
    position_ids restarting at 0 for every example."""
    bins = best_fit_decreasing([len(x) for x in batch["input_ids"]], block_size)
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for members in bins:
        out["input_ids"].append(list(chain.from_iterable(batch["input_ids"][i] for i in members)))
        out["labels"].append(list(chain.from_iterable(batch["labels"][i] for i in members)))
        out["position_ids"].append(list(chain.from_iterable(range(len(batch["input_ids"][i])) for i in members)))
    return out
