"""The planner's measured figures, read from the data file shipped beside this module (`measured.json`).

Why a data file: measurements change when a benchmark runs again, code should not; each row names the report that
holds it, so a figure is checked against its source (tests/unit/test_calibration.py) and never typed twice.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

FILE = "measured.json"


@functools.cache
def load() -> dict[str, Any]:
    """The whole file: `version`, `speeds` (rows of measured tokens/s) and `fixed_terms` (per GPU type)."""
    return json.loads(resources.files(__package__).joinpath(FILE).read_text())


def speeds() -> list[dict[str, Any]]:
    return load()["speeds"]


def fixed_terms() -> dict[str, dict[str, Any]]:
    """GPU type -> its row; a type without its own probe has only what differs from H200's, so it is filled in."""
    rows = load()["fixed_terms"]
    return {gpu: {**rows["H200"], **row} for gpu, row in rows.items()}
