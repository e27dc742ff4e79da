"""The batch arithmetic DeepSpeed asserts: train_batch_size = micro batch x accumulation x world size.

Why one owner: the product and its inverses were written in the planner, its report, config check and convert,
the run's facts and bench, each with its own rounding.
"""

from __future__ import annotations


def global_batch(micro: int, accum: int, world: int) -> int:
    """Sequences per optimizer step over all ranks."""
    return micro * accum * world


def per_rank(total: int, world: int) -> int | None:
    """Sequences per rank per optimizer step of a global batch `total` (micro x accumulation); None when the world
    size does not divide it."""
    count, rest = divmod(total, world)
    return count if not rest and count >= 1 else None


def accumulation(total: int, micro: int, world: int) -> int | None:
    """The accumulation that makes `total` from `micro` on `world` ranks; None when no whole number does."""
    count, rest = divmod(total, micro * world)
    return count if not rest and count >= 1 else None


def world_size_of(total: int, micro: int, accum: int) -> int | None:
    """The world size a global batch `total` implies for `micro` x `accum`; None when no whole number does."""
    return accumulation(total, micro, accum)  # the same division: total / (micro x accum)


def data_parallel(world: int, sequence_parallel: int = 1) -> int:
    """Ranks that see different sequences: with sequence parallelism, `sequence_parallel` ranks share each one."""
    return max(world // max(sequence_parallel, 1), 1)
