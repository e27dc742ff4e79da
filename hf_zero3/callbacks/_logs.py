"""Fields our callbacks add to a log record the Trainer is about to hand to its `report_to` integrations."""

from __future__ import annotations

from typing import Any


def merge_into_logs(state, logs: dict[str, Any], values: dict[str, Any]) -> None:
    """Add values to this on_log record and to the copy the Trainer already put in state.log_history."""
    logs.update(values)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(values)
