"""What a complete ZeRO-3 checkpoint is, the completion marker that says so, and keep-last-N over complete ones.

Why: a ZeRO-3 checkpoint is many files written by many ranks. A crash, a kill or a full disk mid-save leaves
a `checkpoint-N` folder that looks saved but cannot be resumed (or holds no usable weights). A checkpoint
counts only when every part was verified after the save and the marker, written last and atomically, says
so: resume, keep-last-N and export look at the marker, never at the folder name alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

DEFAULT_SAVE_STEPS = 500
"""Save every 500 optimizer steps: the default for recipes that run long enough (the tiny one saves every 50)."""
DEFAULT_SAVE_TOTAL_LIMIT = 3
"""Keep the newest 3 complete checkpoints."""

MARKER = "hf_zero3_complete.json"
"""Written into a checkpoint folder last, after every part was verified; lists every file with its size."""
SAVING = "hf_zero3_saving"
"""Written into a checkpoint folder before the save starts, removed with the marker: "ours, unfinished"."""

_STEP = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or cannot be written; the message names the fix."""


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N for a `checkpoint-N` folder name, else None."""
    match = _STEP.match(Path(path).name)
    return int(match.group(1)) if match else None


def weights_gathered(ds_config: dict | None) -> bool:
    """Whether a save writes full 16-bit weights: always, unless ZeRO-3 runs with 16-bit gathering off."""
    zero = (ds_config or {}).get("zero_optimization", {})
    return zero.get("stage") != 3 or bool(zero.get("stage3_gather_16bit_weights_on_model_save"))


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Every `checkpoint-N` folder in output_dir, oldest step first, complete or not."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def _zip_problem(path: Path) -> str | None:
    """torch.save files are zip archives: a truncated or empty one has no readable central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                return f"{path.name} holds no pickled object"
    except (OSError, zipfile.BadZipFile) as e:
        return f"{path.name} is unreadable ({e})"
    return None


def deepspeed_tag_dir(checkpoint: Path) -> tuple[Path | None, list[str]]:
    """The `global_stepN` folder that `latest` names, or the problems finding it."""
    try:
        tag = (checkpoint / "latest").read_text().strip()
    except OSError:
        return None, ["no `latest` tag file (DeepSpeed did not finish its save)"]
    if not tag or not (checkpoint / tag).is_dir():
        return None, [f"`latest` names {tag!r}, which is not a folder here"]
    return checkpoint / tag, []


def verify_rank_files(checkpoint: str | os.PathLike, rank: int, world_size: int,
                      deepspeed: bool = True) -> list[str]:
    """Problems with one rank's own files: its DeepSpeed model/optimizer shards and its RNG state.

    Without DeepSpeed the optimizer is one `optimizer.pt`, written by rank 0.
    """
    checkpoint = Path(checkpoint)
    problems = []
    if deepspeed:
        tag_dir, tag_problems = deepspeed_tag_dir(checkpoint)
        if tag_dir is None:
            return [f"rank {rank}: {p}" for p in tag_problems]
        for kind in ("model_states", "optim_states"):
            if kind == "model_states":
                shards, required = model_states_files(tag_dir, rank)
            else:
                shards, required = sorted(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_*_{kind}.pt")), True
            if not shards and required:
                problems.append(f"rank {rank}: no {kind} shard in {tag_dir.name}")
            problems += [f"rank {rank}: {p}" for shard in shards if (p := _zip_problem(shard))]
    elif rank == 0 and (p := _zip_problem(checkpoint / "optimizer.pt")):
        problems.append(p)
    rng = checkpoint / (f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth")
    if p := _zip_problem(rng):
        problems.append(f"rank {rank}: RNG state {p}")
    return problems


def model_states_files(tag_dir: Path, rank: int) -> tuple[list[Path], bool]:
    """(this rank's model-states files, whether the rank must have one).

    ZeRO-3 writes one `*zero_pp_rank_R_mp_rank_00_model_states.pt` per rank; ZeRO-0/1/2 write a single
    `mp_rank_00_model_states.pt` from rank 0 and none from the other ranks.
    """
    zero3 = sorted(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_*_model_states.pt"))
    if zero3:
        return zero3, True
    dense = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if dense:
        return (dense if rank == 0 else []), rank == 0
    return [], True


def _weight_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint / name for name in names]
    single = checkpoint / "model.safetensors"
    return [single] if single.is_file() else []


def param_shapes(checkpoint: str | os.PathLike) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> shape of every trained parameter, tied name -> the name it shares) from rank 0's model states."""
    import torch

    tag_dir, problems = deepspeed_tag_dir(Path(checkpoint))
    if tag_dir is None:
        raise CheckpointError(f"{checkpoint}: {problems[0]}")
    model_states, _ = model_states_files(tag_dir, 0)
    if not model_states:
        raise CheckpointError(f"{checkpoint}: no model_states file of rank 0 in {tag_dir.name}")
    # mmap: below ZeRO-3 this file holds the whole 16-bit model; only its metadata is read here
    state = torch.load(model_states[0], map_location="cpu", weights_only=True, mmap=True)
    shapes = {name: tuple(shape) for group in state["param_shapes"] for name, shape in group.items()}
    shapes.update({name: tuple(shape) for name, shape in (state.get("frozen_param_shapes") or {}).items()})
    return shapes, dict(state.get("shared_params") or {})


def verify_weights(checkpoint: str | os.PathLike, shapes_from: str | os.PathLike | None = None) -> list[str]:
    """Problems with the gathered 16-bit weights: every trained parameter present, right shape, not empty.

    "Trained parameters" are the ones DeepSpeed's model states list (tied copies excepted). Reads only
    headers, so it costs milliseconds even for a 70B model. `shapes_from`: the DeepSpeed checkpoint to
    compare with (default: `checkpoint` itself; an exported folder passes its source).
    """
    from safetensors import safe_open

    checkpoint = Path(checkpoint)
    files = _weight_files(checkpoint)
    if not files:
        return ["no model.safetensors (16-bit weights gathering is on, so the Trainer should have written it)"]
    saved: dict[str, tuple[int, ...]] = {}
    for path in files:
        if not path.is_file():
            return [f"weight shard {path.name} is missing"]
        try:
            with safe_open(path, framework="pt") as f:
                saved.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        except Exception as e:  # safetensors raises its own error types for a truncated header
            return [f"{path.name} is unreadable ({e})"]
    source = Path(shapes_from or checkpoint)
    expected, tied = param_shapes(source) if (source / "latest").is_file() else ({}, {})
    problems = [f"{name}: saved with shape {saved[name]} (no values)" for name in saved if 0 in saved[name]]
    missing = [n for n in expected if n not in saved and n not in tied]
    wrong = [n for n in expected if n in saved and saved[n] != expected[n]]
    if missing:
        problems.append(f"{len(missing)} trained parameter(s) missing from the weights, e.g. {missing[0]}")
    problems += [f"{n}: shape {saved[n]} in the weights, {expected[n]} trained" for n in wrong[:3]]
    return problems


def verify_checkpoint(checkpoint: str | os.PathLike) -> list[str]:
    """Every problem that keeps a DeepSpeed `checkpoint` from being resumed (empty list: complete).

    The full check the guard runs after a save, for a folder without a marker. World size and whether 16-bit
    weights were gathered come from what DeepSpeed recorded in rank 0's model states.
    """
    import torch

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        return [f"{checkpoint} is not a folder"]
    tag_dir, problems = deepspeed_tag_dir(checkpoint)
    if tag_dir is None:
        return problems
    shards, _ = model_states_files(tag_dir, 0)
    if not shards or _zip_problem(shards[0]):
        return [f"rank 0: no readable model_states shard in {tag_dir.name}"]
    try:
        states = torch.load(shards[0], map_location="cpu", weights_only=True, mmap=True)
        gathered = weights_gathered(states.get("ds_config"))
        for rank in range(states["dp_world_size"]):
            problems += verify_rank_files(checkpoint, rank, states["dp_world_size"])
        problems += verify_shared_files(checkpoint, weights=gathered)
    except OSError as e:  # a file vanished while we looked (another rank cleaning up)
        problems.append(f"unreadable: {e}")
    return problems


def verify_shared_files(checkpoint: str | os.PathLike, weights: bool) -> list[str]:
    """Problems with the files rank 0 writes: trainer state (with the right step) and the 16-bit weights."""
    checkpoint = Path(checkpoint)
    problems = []
    state_file = checkpoint / "trainer_state.json"
    try:
        step = json.loads(state_file.read_text())["global_step"]
        if step != checkpoint_step(checkpoint):
            problems.append(f"trainer_state.json says step {step}, the folder says {checkpoint_step(checkpoint)}")
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"trainer_state.json is missing or unreadable ({e})")
    if weights:
        problems += verify_weights(checkpoint)
    return problems


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(checkpoint: str | os.PathLike, info: dict) -> Path:
    """Flush every file of the checkpoint to disk, then write the marker atomically (tmp + fsync + rename)."""
    checkpoint = Path(checkpoint)
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name not in (MARKER, SAVING)):
        _fsync(path)
        files[str(path.relative_to(checkpoint))] = path.stat().st_size
    for folder in {p.parent for p in checkpoint.rglob("*")} | {checkpoint}:
        _fsync(folder)
    record = {"step": checkpoint_step(checkpoint), **info, "bytes": sum(files.values()), "files": files}
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


def is_complete(checkpoint: str | os.PathLike) -> bool:
    """The marker is there and every file it lists is still there with its size (cheap: stats only)."""
    record = read_marker(checkpoint)
    if record is None or record.get("step") != checkpoint_step(checkpoint):
        return False
    root = Path(checkpoint)
    for name, size in record.get("files", {}).items():
        path = root / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in output_dir, oldest step first."""
    return [p for p in list_checkpoints(output_dir) if is_complete(p)]


def newest_complete(output_dir: str | os.PathLike) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def remove_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Delete a checkpoint folder; a symlinked one loses only the link (we never delete outside output_dir)."""
    path = Path(checkpoint)
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def mark_saving(checkpoint: str | os.PathLike) -> None:
    """Before a save: flag the folder as ours and unfinished, and drop an old marker that would otherwise vouch
    for a half-rewritten checkpoint."""
    checkpoint = Path(checkpoint)
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / MARKER).unlink(missing_ok=True)
    (checkpoint / SAVING).write_text("a save into this folder started; hf_zero3_complete.json marks its end\n")


def rotate(output_dir: str | os.PathLike, keep: int | None,
           protect: str | os.PathLike | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns the deleted ones.

    Incomplete folders never count and are never deleted here (a crashed save is cleaned up when the run
    resumes; a folder without a marker may hold another tool's checkpoint). `keep` < 1 is taken as 1, so the
    newest complete checkpoint always stays; so does `protect` (the best model, if tracked).
    """
    if keep is None:
        return []
    complete = complete_checkpoints(output_dir)
    keep_set = set(complete[-max(keep, 1):])
    if protect is not None:
        keep_set |= {p for p in complete if p.resolve() == Path(protect).resolve()}
    deleted = [p for p in complete if p not in keep_set]
    for path in deleted:
        remove_checkpoint(path)
    return deleted


def plan_resume(output_dir: str | os.PathLike, resume: str | None,
                world_size: int) -> tuple[Path | None, list[Path]]:
    """(checkpoint to resume from, half-written checkpoints to delete first) for `resume` = 'auto' or a path.

    'auto' takes the newest complete checkpoint (None if there is none). Folders newer than the resume point
    are deleted when a save of ours never finished there (SAVING flag, no marker) or they fail verification:
    the resumed run would write into them and mix old and new files. Anything newer that could still be good
    is never touched: that is an error naming the fix, as is a checkpoint written by a different number of
    ranks without a universal copy.
    """
    if resume == "auto":
        target = newest_complete(output_dir)
    else:
        target = Path(resume)
        if not is_complete(target) and (problems := verify_checkpoint(target)):
            raise CheckpointError(f"{target} cannot be resumed: {'; '.join(problems[:5])}. Resume from a complete "
                                  f"checkpoint (newest in output_dir: {newest_complete(output_dir)}) or pass "
                                  "--resume_from_checkpoint auto")
    start = checkpoint_step(target) if target is not None else -1
    same = target.resolve() if target is not None else None
    newer = [p for p in list_checkpoints(output_dir) if checkpoint_step(p) > start and p.resolve() != same]
    broken = [p for p in newer if not is_complete(p) and ((p / SAVING).is_file() or verify_checkpoint(p))]
    kept = [p for p in newer if p not in broken]
    if kept:
        raise CheckpointError(f"{', '.join(map(str, kept))}: newer than the resume point {target}, would be "
                              "overwritten: move it out of output_dir, or resume from the newest complete "
                              "checkpoint with 'auto'")
    if target is not None:
        written_by = (read_marker(target) or {}).get("world_size")
        if written_by not in (None, world_size) and not (target / "latest_universal").is_file():
            raise CheckpointError(f"{target} was written by {written_by} ranks and this run has {world_size}: run "
                                  f"`hf-zero3 reshard {target}` once, then resume with "
                                  '"checkpoint": {"load_universal": true} in the ds_config')
    return target, broken
