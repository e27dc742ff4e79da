"""output_dir's `checkpoint-N` folders, each classified (complete, unfinished, empty, damaged, foreign), the nodes'
views combined, keep-last-N over the complete ones, and where a run resumes.

Why: nothing is deleted unless it is provably our own unfinished write; every other folder is left in place and
named with the fix (hf_zero3.checkpoint.lifecycle holds the records that say which is which).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hf_zero3.checkpoint.contents import universal_tag, verify_checkpoint
from hf_zero3.checkpoint.lifecycle import (
    FAILED,
    SAVING,
    CheckpointError,
    checkpoint_step,
    complete_checkpoints,
    finish_deletions,
    list_checkpoints,
    missing_files,
    read_json,
    read_marker,
    read_run_id,
    remove_checkpoint,
    resume_step,
    saving_record,
    verify_complete,
)


@dataclass(frozen=True)
class Found:
    """A `checkpoint-N` folder and what it is: complete (marker, every file there), unfinished (our own save that
    never finished: deletable), empty (nothing to lose: a save may write into it), damaged (marked, but files gone
    or resized), or foreign (anything else)."""

    path: Path
    kind: str
    why: str = ""
    ours: bool = False
    """Written by this output_dir's run (its run id in the save flag, or in the marker): deletable when unfinished."""

    @property
    def step(self) -> int:
        return checkpoint_step(self.path)


def classify(checkpoint: str | os.PathLike, run_id: str | None) -> Found:
    """What a `checkpoint-N` folder is (stats only). `run_id`: the output_dir's (see `claim_output_dir`)."""
    path = Path(checkpoint)
    record = read_marker(path)
    if record is not None:
        if (failed := read_json(path / FAILED)) is not None:
            return Found(path, "damaged", f"failed verification on {failed.get('at')}: {failed.get('problems')}")
        if record.get("step") != checkpoint_step(path):
            return Found(path, "damaged", f"its marker is for step {record.get('step')}")
        problems = missing_files(path, record)
        if problems:
            return Found(path, "damaged", f"marked complete, but {'; '.join(problems[:3])}")
        return Found(path, "complete", ours=run_id is not None and record.get("run_id") == run_id)
    saving = saving_record(path)
    if saving is not None and run_id is not None and saving.get("run_id") == run_id \
            and saving.get("step") == checkpoint_step(path):
        return Found(path, "unfinished", "a save of this run started there and never finished (no marker)", True)
    if path.is_dir() and not any(path.iterdir()):
        return Found(path, "empty", "an empty folder")
    if (path / SAVING).exists():
        return Found(path, "foreign", "a save flag that is not this output_dir's run (another run's copy, or an "
                                      "older hf_zero3), and no completion marker")
    return Found(path, "foreign", "no hf_zero3 completion marker (written by another tool, by hand, or copied)")


def survey(output_dir: str | os.PathLike) -> list[Found]:
    """Every `checkpoint-N` folder of output_dir, classified, oldest step first."""
    run_id = read_run_id(output_dir)
    return [classify(p, run_id) for p in list_checkpoints(output_dir)]


def view(found: list[Found]) -> dict[str, tuple[str, str, bool]]:
    """{folder name: (kind, why, ours)}: what one rank sees, to gather from every rank (`combine`)."""
    return {f.path.name: (f.kind, f.why, f.ours) for f in found}


def combine(output_dir: str | os.PathLike, views: list[dict[str, tuple[str, str, bool]]]) -> list[Found]:
    """Every `checkpoint-N` of output_dir as all ranks together see it (`view` of each rank's `survey`), oldest
    first, with this rank's paths. On one folder that every node shares all views are the same; on node-local
    disks each node sees its own copy, and a checkpoint is what its copies together are:

    - complete when it is complete on every node;
    - unfinished (deletable) when each copy is this run's, complete or unfinished, or absent, and one is not
      complete: a save that finished on some nodes only (a node lost mid-save);
    - damaged when a copy is damaged, else foreign when a copy is foreign (neither ever deleted).
    """
    names = sorted({name for v in views for name in v}, key=lambda n: checkpoint_step(n))
    found = []
    for name in names:
        copies = [v.get(name, ("absent", "not on this node", False)) for v in views]
        kinds = {kind for kind, _, _ in copies}
        path = Path(output_dir) / name
        if kinds == {"complete"}:
            found.append(Found(path, "complete", ours=all(ours for _, _, ours in copies)))
        elif kinds <= {"complete", "unfinished", "absent", "empty"} \
                and all(ours for kind, _, ours in copies if kind in ("complete", "unfinished")) \
                and kinds & {"complete", "unfinished"}:
            why = ("complete on some nodes only: a save that did not finish on every node" if "complete" in kinds
                   else next(why for kind, why, _ in copies if kind == "unfinished"))
            found.append(Found(path, "unfinished", why, True))
        else:
            kind = "damaged" if "damaged" in kinds else "foreign" if kinds & {"foreign", "complete", "unfinished"} \
                else "empty"
            why = next((why for k, why, _ in copies if k == kind), "")
            if kind != "empty" and len(views) > 1 and kinds != {kind}:
                why = f"on some node: {why}"
            found.append(Found(path, kind, why))
    return found


def describe_found(found: list[Found]) -> str:
    """One line: each folder with why it was not resumed from."""
    return "; ".join(f"{f.path.name}: {f.why or f.kind}" for f in found)


def rotate(output_dir: str | os.PathLike, keep: int | None,
           protect: str | os.PathLike | None = None, everywhere: set[int] | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; returns the deleted ones.

    Only complete checkpoints count and only they are deleted (an unfinished save is cleaned up when the run
    resumes; a damaged or foreign folder stays where it is). `keep` < 1 is taken as 1, so the newest complete
    checkpoint always stays; so does `protect` (the best model, if tracked). `everywhere`: the steps complete on
    every node (node-local disks): only those count. Each deletion goes through a `.deleting-` rename, and
    leftovers of a killed rotation are finished first.
    """
    if keep is None:
        return []
    finish_deletions(output_dir)
    complete = [p for p in complete_checkpoints(output_dir) if everywhere is None or checkpoint_step(p) in everywhere]
    keep_set = set(complete[-max(keep, 1):])
    if protect is not None:
        keep_set |= {p for p in complete if p.resolve() == Path(protect).resolve()}
    deleted = [p for p in complete if p not in keep_set]
    for path in deleted:
        remove_checkpoint(path)
    return deleted


@dataclass
class ResumePlan:
    """Where a run starts: `target` (None: from scratch), our unfinished saves to delete first, and the folders
    left in place, each with why it was not resumed from."""

    target: Path | None
    delete: list[Path] = field(default_factory=list)
    skipped: list[Found] = field(default_factory=list)
    failed: list[Found] = field(default_factory=list)
    """Marked checkpoints whose files failed verification just now (the caller records it: `mark_failed`)."""


def plan_resume(output_dir: str | os.PathLike, resume: str | None, world_size: int,
                verify: Callable[[Path], list[str]] = verify_complete, found: list[Found] | None = None) -> ResumePlan:
    """The resume plan for `resume` = 'auto' or a checkpoint path.

    'auto' takes the newest complete checkpoint whose files all verify (`verify`: checksums; in a multi-rank
    run each rank checks its share, and the caller gathers), falling back one by one; it never picks a damaged or
    foreign folder. Our unfinished saves newer than the start are deleted (the run would write into them and mix
    old and new files). Anything else stays and is listed in `skipped`. An explicit path must verify; a complete
    checkpoint newer than it is an error (resuming the older one would overwrite it), as is a checkpoint written by
    another number of ranks without a universal copy. `found`: the folders as every rank sees them (`combine`;
    default: this rank's `survey`).
    """
    found = survey(output_dir) if found is None else found
    if resume == "auto":
        target, skipped = None, []
        for item in reversed([f for f in found if f.kind == "complete"]):
            problems = verify(item.path)
            if not problems:
                target = item.path
                break
            skipped.append(Found(item.path, "damaged", f"fails verification: {'; '.join(problems[:3])}"))
        failed = list(skipped)
    else:
        target, skipped, failed = Path(resume), [], []
        problems = verify(target) if read_marker(target) is not None else verify_checkpoint(target)
        if problems:
            good = newest_verified(found, verify, before=resume_step(target))
            raise CheckpointError(
                f"{target} cannot be resumed: {'; '.join(problems[:5])}. Resume from the newest checkpoint that "
                + (f"verifies: --resume_from_checkpoint {good}" if good else "verifies (none in output_dir does)")
                + ", or pass --resume_from_checkpoint auto; move the folder aside to keep it out of the way")
    start = resume_step(target) if target is not None and resume_step(target) is not None else -1
    same = target.resolve() if target is not None else None
    newer = [f for f in found if f.step > start and f.path.resolve() != same]
    if resume != "auto" and (complete := [f.path.name for f in newer if f.kind == "complete"]):
        raise CheckpointError(f"{', '.join(complete)} in {output_dir}: complete and newer than the resume point "
                              f"{target}, so this run would overwrite it: move it out of output_dir, or resume from "
                              "the newest complete checkpoint with --resume_from_checkpoint auto")
    delete = [f.path for f in newer if f.kind == "unfinished"]
    skipped_paths = {f.path for f in skipped}
    skipped += [f for f in found if f.kind in ("damaged", "foreign") and f.path not in skipped_paths]
    if target is not None:
        written_by = (read_marker(target) or {}).get("world_size")
        if written_by not in (None, world_size) and universal_tag(target) is None:
            raise CheckpointError(f"{target} was written by {written_by} ranks and this run has {world_size}: run "
                                  f"`hf-zero3 reshard {target}` once, then resume with "
                                  '"checkpoint": {"load_universal": true} in the ds_config')
    return ResumePlan(target, delete, sorted(skipped, key=lambda f: f.step), failed)


def newest_verified(found: list[Found], verify: Callable[[Path], list[str]] = verify_complete,
                    before: int | None = None) -> Path | None:
    """The newest complete checkpoint (older than step `before`, if given) whose files verify."""
    for item in reversed([f for f in found if f.kind == "complete"]):
        if (before is None or item.step < before) and not verify(item.path):
            return item.path
    return None


def save_collisions(output_dir: str | os.PathLike, after_step: int, last_step: int,
                    save_every: int | None) -> list[Found]:
    """Folders that a run going from `after_step` to `last_step` would save into but must not touch: anything
    there that is not our own unfinished save. `save_every`: steps between saves (None: any step may save)."""
    def saves_at(step: int) -> bool:
        return after_step < step <= last_step and (not save_every or step % save_every == 0 or step == last_step)

    return [f for f in survey(output_dir) if saves_at(f.step) and f.kind not in ("unfinished", "empty")]
