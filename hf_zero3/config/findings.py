"""What a ds_config check reports: one finding, where (dotted key), what, and the fix; and the dotted lookup every
check reads the config with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Level = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One problem or note about a config: where (dotted key), what, and the fix."""

    level: Level
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key else ""
        return f"{self.level.upper():7} {where}{self.message}"


def lookup(config: dict, dotted: str, default: Any = None) -> Any:
    """config["a"]["b"] for "a.b", or `default` where a part is missing or not a block."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
