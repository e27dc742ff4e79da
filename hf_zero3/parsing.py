"""JSON and YAML text a user hands us (a command-line override, a data column, a config file): parsed behind one
error path.

Why one owner: each caller caught its own subset of the parsers' errors (JSONDecodeError here, YAMLError there, a
ScannerError nowhere), so a cut-off `{` ended in a traceback in one place and a clear line in another. Every parse
here raises `ParseError` (a ValueError, for every layer), whose message names where the text came from, where in
it the parser stopped, what it found, and the fix the caller gives.
"""

from __future__ import annotations

import json
from typing import Any

import yaml


class ParseError(ValueError):
    """Text that is not the JSON or YAML it should be; the message names where, what and the fix."""


def _yaml_error(error: Exception, source: str, fix: str) -> ParseError:
    mark = getattr(error, "problem_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    what = getattr(error, "problem", None) or str(error).splitlines()[0]
    return ParseError(f"{where}: invalid YAML: {what}. {fix}")


def parse_json(text: str | bytes, source: str, fix: str) -> Any:
    """`text` as JSON, or a ParseError `source:line:column: invalid JSON: what. fix`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ParseError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}. {fix}") from None
    except UnicodeDecodeError as e:
        raise ParseError(f"{source}: not text (byte {e.start} is not UTF-8). {fix}") from None


def parse_yaml(text: str, source: str, fix: str) -> Any:
    """`text` as YAML (safe_load), or a ParseError `source:line:column: invalid YAML: what. fix`."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _yaml_error(e, source, fix) from None


def parse_value(text: str, source: str, fix: str) -> Any:
    """A dict or list written on a command line: JSON first (it reads 1e-5 as a number; YAML 1.1 keeps it a
    string), else YAML's flow style (`{r: 8, lora_alpha: 16}`); a ParseError says what YAML found wrong."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return parse_yaml(text, source, fix)
