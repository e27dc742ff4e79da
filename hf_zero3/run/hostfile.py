"""DeepSpeed's hostfile, read and written as its launcher reads it: `hostname slots=N`, one line per host.

Why its own module: the launcher (`HOSTFILE`, `HOSTS`) and the doctor read the same grammar, and the doctor sits
above the run; the grammar belongs to neither.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


class HostfileError(ValueError):
    """A hostfile DeepSpeed would refuse or misread; the message names the line and the fix."""


HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
"""DeepSpeed's own pattern (`deepspeed.launcher.runner._parse_hostfile`), searched in each stripped line: what
follows `slots=N` is ignored there (`max_slots=8`, a comment), and `slots = 2` is refused."""
HOSTFILE_FIX = "each line: `hostname slots=N` (no spaces around =), one line per host; `#` starts a comment"


def _hostfile_hint(line: str) -> str:
    spaced = re.match(r"(\S+)\s+slots\s*=\s*(\d+)", line)
    if spaced:
        return f"write `{spaced.group(1)} slots={spaced.group(2)}` (DeepSpeed takes no spaces around =)"
    if len(line.split()) == 1:
        return f"add the number of ranks: `{line} slots=N`"
    return "write `hostname slots=N`"


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Hosts and slots as DeepSpeed's launcher reads them: the same lines accepted, the same slots (slots=0
    included), the same lines refused; where DeepSpeed stops at the first bad line with a bare message, every
    bad line is named here with its fix. `text` as Python reads a file (universal newlines, like DeepSpeed)."""
    hosts, errors = {}, []
    for number, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.search(line)
        if match is None:
            errors.append(f"{source}:{number}: {line!r} is not `hostname slots=N`: {_hostfile_hint(line)}")
        elif match.group(1) in hosts:
            errors.append(f"{source}:{number}: host {match.group(1)} is listed twice: keep one line per host")
        else:
            hosts[match.group(1)] = int(match.group(2))
    if not hosts and not errors:
        errors.append(f"{source}: no hosts: add one line `hostname slots=N` per node")
    if errors:
        raise HostfileError("; ".join(errors))
    return hosts


def read_hostfile(path: str | os.PathLike) -> dict[str, int]:
    """`parse_hostfile` of the file at `path`, read as DeepSpeed reads it; HostfileError names the file."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not a text file"
        raise HostfileError(f"cannot read hostfile {path}: {reason}: pass a readable DeepSpeed hostfile "
                            "(lines `hostname slots=N`)") from e
    return parse_hostfile(text, str(path))


def write_hostfile(path: Path, hosts: dict[str, int]) -> None:
    """DeepSpeed's `host slots=N` lines, replaced atomically: with NO_SSH every node may write the same file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    tmp.write_text("".join(f"{host} slots={slots}\n" for host, slots in hosts.items()))
    os.replace(tmp, path)
