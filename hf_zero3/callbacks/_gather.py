"""Collect one small record per rank on every rank (all ranks must call it at the same step)."""

from __future__ import annotations

from typing import Any


def gather_from_ranks(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `record`, ordered by rank; just `[record]` without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def merge_into_logs(state, logs: dict[str, Any], values: dict[str, Any]) -> None:
    """Add values to this on_log record and to the copy the Trainer already put in state.log_history."""
    logs.update(values)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(values)
