"""What a complete ZeRO-3 checkpoint is and the records that say so (keep-last-N and resume: `folders`).

Why: a ZeRO-3 checkpoint is many files written by many ranks. A crash, a kill or a full disk mid-save leaves
a `checkpoint-N` folder that looks saved but cannot be resumed (or holds no usable weights); a bit flip or a
lost file later leaves one that looks complete but is not. A checkpoint counts only when every part was
verified after the save and the marker, written last and atomically, lists every file with its size and
checksum: resume verifies those before DeepSpeed opens a file. Nothing is ever deleted unless it is provably
our own unfinished write (or a rotation of ours that a kill interrupted); anything else is left in place and
reported by name with the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

DEFAULT_SAVE_STEPS = 500
"""Save every 500 optimizer steps: the default for recipes that run long enough (the tiny one saves every 50)."""
DEFAULT_SAVE_TOTAL_LIMIT = 3
"""Keep the newest 3 complete checkpoints."""

MARKER = "hf_zero3_complete.json"
"""Written into a checkpoint folder last, after every part was verified; lists every file with size and checksum."""
SAVING = "hf_zero3_saving"
"""Written into a checkpoint folder before the save starts, removed with the marker: "ours, unfinished". Holds the
run id of the output_dir and the step, so only a save that a run on this output_dir started is ever deleted."""
FAILED = "hf_zero3_failed.json"
"""Written into a marked checkpoint whose files failed their checksums when a run looked for one to resume: from
then on it is damaged, never complete. Otherwise keep-last-N would still count it (by size it looks whole) and, its
step being higher, keep it and delete the good checkpoints the resumed run writes. The folder stays for the user."""
RUN_ID = "hf_zero3_run.json"
"""In output_dir: the id of the run that owns it (created when a run starts there)."""
FINISHED = "hf_zero3_finished.json"
"""In output_dir: written after the final model and metrics, removed when training starts again."""
DELETING = ".deleting-"
"""Rotation renames `checkpoint-N` to `.deleting-checkpoint-N` before deleting it: a kill mid-delete leaves a name
that nothing counts, and the next start finishes the deletion."""
HASH = "xxh3_64"
"""Checksum of every file in the marker: xxHash3, ~3.6 GB/s per core from the page cache (crc32: ~1.9)."""

_STEP = re.compile(r"^checkpoint-(\d+)$")
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_|rng_state_(\d+)\.pth$")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or cannot be written; the message names the fix."""


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N for a `checkpoint-N` folder name, else None."""
    match = _STEP.match(Path(path).name)
    return int(match.group(1)) if match else None


def resume_step(checkpoint: str | os.PathLike) -> int | None:
    """The step a checkpoint folder holds: N of its name, or of the folder a link (`best`) points to, else its
    trainer state's global_step (a copy renamed by hand); None when none says."""
    path = Path(checkpoint)
    step = checkpoint_step(path)
    if step is None:
        step = checkpoint_step(path.resolve())
    if step is None:
        try:
            step = int(json.loads((path / "trainer_state.json").read_text())["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return step


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where the Trainer saves step `step`: `output_dir/checkpoint-N`."""
    return Path(output_dir) / f"checkpoint-{step}"


def file_hash(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """xxh3_64 of a file's bytes, read in 8 MiB chunks (memory stays flat for a 100 GB shard)."""
    import xxhash

    digest, buffer = xxhash.xxh3_64(), bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def file_owner(name: str, world_size: int, writer: int = 0) -> int:
    """The rank that wrote (and so hashes and verifies) a checkpoint file: its own shards and RNG state; the folder's
    `writer` the rest (rank 0; on node-local disks each node's first rank, which writes that node's copy). A file of
    a rank beyond `world_size` (resuming on fewer ranks) goes to rank % world_size."""
    match = _RANK_FILE.search(name)
    if not match:
        return writer
    return int(match.group(1) or match.group(2)) % max(world_size, 1)


def hash_files(checkpoint: str | os.PathLike, rank: int = 0, world_size: int = 1, writer: int = 0) -> dict[str, str]:
    """{relative path: checksum} of the files of `checkpoint` that `rank` owns (all files for one rank)."""
    root = Path(checkpoint)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (MARKER, SAVING))
    return {str(p.relative_to(root)): file_hash(p) for p in files
            if file_owner(str(p.relative_to(root)), world_size, writer) == rank}


def weights_gathered(ds_config: dict | None) -> bool:
    """Whether a save writes full 16-bit weights: always, unless ZeRO-3 runs with 16-bit gathering off."""
    zero = (ds_config or {}).get("zero_optimization", {})
    return zero.get("stage") != 3 or bool(zero.get("stage3_gather_16bit_weights_on_model_save",
                                                   zero.get("stage3_gather_fp16_weights_on_model_save")))


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Every `checkpoint-N` folder in output_dir, oldest step first, complete or not."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(checkpoint: str | os.PathLike, info: dict, hashes: dict[str, str] | None = None) -> Path:
    """Flush every file of the checkpoint to disk, then write the marker atomically (tmp + fsync + rename).

    `hashes`: checksums the ranks already computed of their own files (`hash_files`); the rest is hashed here.
    """
    checkpoint = Path(checkpoint)
    hashes = dict(hashes or {})
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name not in (MARKER, SAVING)):
        _fsync(path)
        name = str(path.relative_to(checkpoint))
        files[name] = {"size": path.stat().st_size, HASH: hashes.get(name) or file_hash(path)}
    for folder in {p.parent for p in checkpoint.rglob("*")} | {checkpoint}:
        _fsync(folder)
    record = {"step": checkpoint_step(checkpoint), **info, "bytes": sum(f["size"] for f in files.values()),
              "files": files}
    tmp = checkpoint / f".{MARKER}.tmp"
    with tmp.open("w") as f:
        json.dump(record, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / MARKER)
    (checkpoint / SAVING).unlink(missing_ok=True)
    _fsync(checkpoint)
    return checkpoint / MARKER


def read_marker(checkpoint: str | os.PathLike) -> dict | None:
    """The marker's record, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(checkpoint) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _listed(record: dict) -> dict[str, dict]:
    """The marker's files as {name: {"size": ..., "xxh3_64": ...}}; markers before checksums held sizes only."""
    return {name: entry if isinstance(entry, dict) else {"size": entry}
            for name, entry in record.get("files", {}).items()}


def missing_files(checkpoint: str | os.PathLike, record: dict) -> list[str]:
    """Files the marker lists that are gone or changed size (cheap: stats only)."""
    root, problems = Path(checkpoint), []
    for name, entry in _listed(record).items():
        path = root / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, the marker says {entry['size']}")
    return problems


def is_complete(checkpoint: str | os.PathLike) -> bool:
    """The marker is there and every file it lists is still there with its size (cheap: stats only; resume also
    compares checksums, `verify_complete`)."""
    record = read_marker(checkpoint)
    return (record is not None and record.get("step") == checkpoint_step(checkpoint)
            and not (Path(checkpoint) / FAILED).exists() and not missing_files(checkpoint, record))


def verify_complete(checkpoint: str | os.PathLike, rank: int = 0, world_size: int = 1, writer: int = 0) -> list[str]:
    """Problems with the files of a marked checkpoint that `rank` owns: missing, another size, another checksum.

    Every rank checks its share (together: every file, once), so a truncated or flipped shard is caught before
    DeepSpeed opens it. Markers written before checksums are checked by size alone. `writer`: see `file_owner`.
    """
    record = read_marker(checkpoint)
    if record is None:
        return ["no completion marker"]
    root, problems = Path(checkpoint), []
    for name, entry in _listed(record).items():
        if file_owner(name, world_size, writer) != rank:
            continue
        path = root / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, the marker says {entry['size']}")
        elif HASH in entry and file_hash(path) != entry[HASH]:
            problems.append(f"{name} is corrupted (its checksum differs from the one written at save time)")
    return problems


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in output_dir, oldest step first."""
    return [p for p in list_checkpoints(output_dir) if is_complete(p)]


def newest_complete(output_dir: str | os.PathLike) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def remove_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Delete a checkpoint folder: rename it to `.deleting-checkpoint-N` first (atomic), so a kill mid-delete
    leaves no half-deleted `checkpoint-N` that looks like a checkpoint; then delete. A symlinked checkpoint loses
    only the link (we never delete outside output_dir)."""
    path = Path(checkpoint)
    doomed = path.with_name(f"{DELETING}{path.name}")
    if doomed.exists() or doomed.is_symlink():
        _delete(doomed)  # an earlier rotation of the same step that a kill interrupted
    path.rename(doomed)
    _delete(doomed)


def _delete(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def finish_deletions(output_dir: str | os.PathLike) -> list[Path]:
    """Finish the deletions a killed rotation left (`.deleting-checkpoint-N` folders); returns them."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    left = sorted(p for p in root.iterdir() if p.name.startswith(DELETING) and checkpoint_step(p.name[len(DELETING):])
                  is not None)
    for path in left:
        _delete(path)
    return left


def read_run_id(output_dir: str | os.PathLike) -> str | None:
    """The id of the run that owns output_dir, or None when no hf_zero3 run started there."""
    try:
        return json.loads((Path(output_dir) / RUN_ID).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim_output_dir(output_dir: str | os.PathLike, run_id: str | None = None) -> str:
    """The output_dir's run id, created (atomically) when this is the first run there: `run_id` (the id node 0's
    copy holds, for a node-local copy) or a new one. One rank per folder."""
    existing = read_run_id(output_dir)
    if existing is not None:
        return existing
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / RUN_ID, {"run_id": run_id or uuid.uuid4().hex,
                                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return read_run_id(root)


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        json.dump(record, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_saving(checkpoint: str | os.PathLike, run_id: str | None = None) -> None:
    """Before a save: flag the folder as this run's and unfinished, and drop an old marker that would otherwise
    vouch for a half-rewritten checkpoint. `run_id`: the output_dir's (default: read from it)."""
    checkpoint = Path(checkpoint)
    checkpoint.mkdir(parents=True, exist_ok=True)
    run_id = run_id or read_run_id(checkpoint.parent)
    (checkpoint / MARKER).unlink(missing_ok=True)
    _write_json(checkpoint / SAVING, {"run_id": run_id, "step": checkpoint_step(checkpoint),
                                      "note": "a save into this folder started; hf_zero3_complete.json marks its end"})


def read_json(path: Path) -> dict | None:
    """A JSON object from a file; None when it is missing, unreadable or not an object."""
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def saving_record(checkpoint: Path) -> dict | None:
    return read_json(checkpoint / SAVING)


def mark_failed(checkpoint: str | os.PathLike, problems: str) -> None:
    """Record that a marked checkpoint failed verification (rank 0): it counts as damaged from now on."""
    _write_json(Path(checkpoint) / FAILED, {"problems": problems, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                            "note": "its files no longer match the checksums written at save "
                                                    "time; hf_zero3 neither resumes from it nor deletes it"})


def read_finished(output_dir: str | os.PathLike) -> dict | None:
    return read_json(Path(output_dir) / FINISHED)


def write_finished(output_dir: str | os.PathLike, record: dict) -> None:
    """After the final model and metrics are written: the run is done (rank 0)."""
    _write_json(Path(output_dir) / FINISHED, {**record, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def clear_finished(output_dir: str | os.PathLike) -> None:
    """Training starts (again): output_dir is no longer a finished run until it ends."""
    (Path(output_dir) / FINISHED).unlink(missing_ok=True)
