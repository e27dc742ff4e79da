"""Where a run starts, decided before the Trainer exists: from scratch, from a checkpoint, or nothing to do.

Refuses to train over an earlier run unless asked; `resume_from_checkpoint: auto` is one command that always does the
right thing (start, resume from the newest checkpoint that verifies, or say "already finished"). Only our own
unfinished saves are deleted (hf_zero3.checkpoint.lifecycle, docs/checkpoints.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hf_zero3.checkpoint import folders
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.checkpoint.contents import ADAPTER_WEIGHTS
from hf_zero3.checkpoint.folders import rotate
from hf_zero3.checkpoint.lifecycle import resume_step, verify_complete, write_finished
from hf_zero3.job import storage
from hf_zero3.job.arguments import UsageError
from hf_zero3.job.distributed import gather_from_ranks, is_world_process_zero

FINISHED = "finished"
"""`start_point`'s answer when output_dir already holds this run, finished: nothing to train."""

_CHECKPOINT_INTERNALS = ("rng_state", "optimizer.pt", "scheduler.pt", "scaler.pt", "latest", "zero_to_",
                         "hf_zero3_")
"""Top-level checkpoint files that belong to resuming, not to the final model folder."""


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def verify_on_all_ranks(folder: Path, writer: int = 0) -> list[str]:
    """Checksums of a marked checkpoint, each rank its share (all ranks call this in the same order). `writer`: the
    rank that wrote the rest of the copy this rank sees (`storage.node_writer`)."""
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    mine = verify_complete(folder, dist.get_rank() if on else 0, dist.get_world_size() if on else 1, writer)
    return [p for record in gather_from_ranks({"problems": mine}) for p in record["problems"]]


def seen_by_all(output_dir: Path) -> list[folders.Found]:
    """output_dir's checkpoint folders as every rank sees them together (`folders.combine`): on node-local disks a
    checkpoint is complete only when it is complete on every node."""
    views = [r["view"] for r in gather_from_ranks({"view": folders.view(folders.survey(output_dir))})]
    return folders.combine(output_dir, views)


def is_finished(record: dict | None, args) -> bool:
    """Whether a finished record answers this command: same or lower max_steps, or the same epochs."""
    if record is None:
        return False
    if args.max_steps > 0:
        return record.get("global_step", -1) >= args.max_steps
    return record.get("max_steps", 0) <= 0 and record.get("num_train_epochs") == args.num_train_epochs


def finish_from(checkpoint: Path, output_dir: Path, args, everywhere: set[int] | None = None) -> None:
    """The checkpoint is at (or past) max_steps but the run died before its final save: the final model is the
    checkpoint's (the Trainer saved it with the same `save_model`); copy it, then mark the run finished (on each
    node's copy, on node-local disks). `everywhere`: the steps complete on every node, for keep-last-N.
    Resuming instead would train one step past max_steps. A copy, not a hard link: the Trainer rewrites
    output_dir's files in place (trainer_state.json, the weights) when training goes on, and a link would change
    the checkpoint with them."""
    if args.should_save:
        for path in sorted(checkpoint.iterdir()):
            if path.is_file() and not path.name.startswith(_CHECKPOINT_INTERNALS):
                target = output_dir / path.name
                tmp = output_dir / f".{path.name}.tmp"
                tmp.unlink(missing_ok=True)
                shutil.copy2(path, tmp)
                os.replace(tmp, target)
        if is_world_process_zero() and not any(output_dir.glob("model*.safetensors")) \
                and not (output_dir / ADAPTER_WEIGHTS).is_file():
            print(f"hf_zero3: {checkpoint} holds no 16-bit weights (gathering is off): `hf-zero3 export {checkpoint} "
                  "<folder>` writes the final model", flush=True)
        # the killed run may not have rotated yet
        for old in rotate(output_dir, args.save_total_limit, everywhere=everywhere):
            print(f"hf_zero3: deleted {old} (keeping the newest {args.save_total_limit} complete)", flush=True)
        write_finished(output_dir, {"global_step": resume_step(checkpoint), "max_steps": args.max_steps,
                                    "num_train_epochs": args.num_train_epochs, "from_checkpoint": str(checkpoint)})
    barrier()


def start_point(args) -> str | None:
    """Where this run starts: None (from scratch), a checkpoint path, or FINISHED (nothing to do).

    Refuses to train over an earlier run unless asked. `resume_from_checkpoint: auto` is one command that always
    does the right thing, for retry loops and requeues: start when nothing is there, resume from the newest
    checkpoint that verifies, and say "already finished" when the run is done. Only our own unfinished saves are
    deleted; everything else is left in place and named (hf_zero3.checkpoint.lifecycle, docs/checkpoints.md).
    """
    output_dir, resume = Path(args.output_dir), args.resume_from_checkpoint
    _check_paths(output_dir, resume, args)
    if resume == "auto" and _already_finished(output_dir, args):
        return FINISHED
    if resume is not None:
        start = _resume(output_dir, resume, args)
        if start is not None:
            return start
    _refuse_to_overwrite(output_dir, resume, args)
    return None


def _check_paths(output_dir: Path, resume: str | None, args) -> None:
    """output_dir and resume_from_checkpoint are folders; every node holds the same run; an interrupted rotation is
    finished."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"output_dir {output_dir} is a file, not a folder: choose another output_dir")
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise UsageError(f"resume_from_checkpoint {resume} is not a directory: pass a checkpoint-N folder "
                         "or 'auto' for the newest complete one in output_dir")
    if storage.check(args) == storage.NODE_LOCAL:
        _same_run_on_every_node(output_dir, args)
    if args.should_save:
        for left in ckpt.finish_deletions(output_dir):
            print(f"hf_zero3: finished deleting {left} (a rotation that was interrupted)", flush=True)


def _already_finished(output_dir: Path, args) -> bool:
    """Whether every rank sees this run finished in output_dir (said once, by rank 0)."""
    finished = is_finished(ckpt.read_finished(output_dir), args)
    if not all(r["finished"] for r in gather_from_ranks({"finished": finished})):
        return False
    if is_world_process_zero():
        record = ckpt.read_finished(output_dir)
        print(f"hf_zero3: {output_dir} already finished at step {record.get('global_step')} (final model there): "
              "nothing to do. Raise --max_steps (or num_train_epochs) to train further", flush=True)
    return True


def _resume(output_dir: Path, resume: str, args) -> str | None:
    """The checkpoint to resume from, FINISHED when it is at max_steps already, or None (nothing to resume: start
    from scratch). Deletes only this run's unfinished saves, after every rank has decided."""
    try:
        found = seen_by_all(output_dir)
        writer = storage.node_writer(args)
        plan = folders.plan_resume(output_dir, resume, int(os.environ.get("WORLD_SIZE", "1")),
                                   verify=lambda folder: verify_on_all_ranks(folder, writer), found=found)
    except ckpt.CheckpointError as e:
        raise UsageError(str(e)) from e
    if resume == "auto" and plan.target is None and plan.skipped:
        raise UsageError(f"nothing to resume in {output_dir}, and it holds checkpoint folders that are not "
                         f"complete: {folders.describe_found(plan.skipped)}. Nothing was deleted. Move them out of "
                         "output_dir (or choose another output_dir) to start over")
    for found_one in plan.skipped if is_world_process_zero() else []:
        print(f"hf_zero3: not resuming from {found_one.path}: {found_one.why}. It stays where it is (move it aside "
              f"if you do not need it); resuming from {plan.target}", flush=True)
    target = plan.target
    if target is not None and args.max_steps > 0 and ckpt.resume_step(target) is not None \
            and ckpt.resume_step(target) >= args.max_steps:
        finish_from(target, output_dir, args, {f.step for f in found if f.kind == "complete"})
        if is_world_process_zero():
            print(f"hf_zero3: {target} is at step {ckpt.resume_step(target)} >= max_steps {args.max_steps}: "
                  f"the run is finished; its final model is in {output_dir}", flush=True)
        return FINISHED
    barrier()  # every rank has decided before rank 0 deletes anything
    for folder in plan.delete if args.should_save else []:  # each node its copy, on node-local disks
        if folder.exists():
            print(f"hf_zero3: removing {folder}: its save never finished (no completion marker on every "
                  "node)", flush=True)
            ckpt.remove_checkpoint(folder)
    barrier()  # deletions done before any rank looks at the folder again
    _refuse_save_collisions(output_dir, ckpt.resume_step(target) if target is not None else 0, args)
    if target is None:
        return None
    for failed in plan.failed if args.should_save else []:  # the run goes on: keep-last-N must
        if ckpt.read_marker(failed.path) is not None:          # never count it again
            ckpt.mark_failed(failed.path, failed.why)
    return str(target)


def _refuse_save_collisions(output_dir: Path, start: int | None, args) -> None:
    """The checkpoint folders this run will save into hold nothing that is not this run's to overwrite."""
    if not (args.max_steps > 0 and args.save_strategy in ("steps", "best")):
        return
    every = int(args.save_steps) if args.save_strategy == "steps" and args.save_steps >= 1 else None
    mine = folders.save_collisions(output_dir, start or 0, args.max_steps, every)
    seen = [c for r in gather_from_ranks({"c": [(f.path.name, f.why) for f in mine]}) for c in r["c"]]
    collisions = [folders.Found(output_dir / name, "foreign", why) for name, why in dict(seen).items()]
    if collisions:
        raise UsageError(f"this run would save into {', '.join(str(f.path) for f in collisions)}, which "
                         f"{'is' if len(collisions) == 1 else 'are'} not this run's to overwrite "
                         f"({folders.describe_found(collisions)}). Nothing was deleted. Move "
                         f"{'it' if len(collisions) == 1 else 'them'} out of output_dir, then run the same "
                         "command again")


def _refuse_to_overwrite(output_dir: Path, resume: str | None, args) -> None:
    """Starting from scratch: output_dir holds nothing of another run, unless --overwrite_output_dir (and even
    then no earlier run's checkpoints)."""
    if output_dir.is_dir() and any(p.name != ckpt.RUN_ID for p in output_dir.iterdir()) \
            and not args.overwrite_output_dir:  # only a claim: a run that stopped before training (bad input)
        if resume == "auto" and (record := ckpt.read_finished(output_dir)) is not None:
            raise UsageError(f"{output_dir} holds a finished run (step {record.get('global_step')}, its final model) "
                             "and no complete checkpoint to continue from, so training further would start from "
                             "scratch and overwrite that model. Nothing was changed. To train on from it, start a "
                             f"new run with --model_name_or_path {output_dir} and another output_dir; to train "
                             "over it, pass --overwrite_output_dir true")
        if resume == "auto" and ckpt.read_run_id(output_dir) is not None:
            if is_world_process_zero():
                print(f"hf_zero3: no complete checkpoint in {output_dir} yet: starting from scratch", flush=True)
        elif resume == "auto":
            raise UsageError(f"output_dir {output_dir} holds files but no hf_zero3 run to resume: pass "
                             "--overwrite_output_dir true to train over it, or choose another output_dir")
        else:
            raise UsageError(f"output_dir {output_dir} already holds a run: pass --resume_from_checkpoint auto to "
                             "continue it, --overwrite_output_dir true to train over it, or choose another output_dir")
    old_checkpoints = sorted(p.name for p in ckpt.list_checkpoints(output_dir) if any(p.iterdir()))
    if args.overwrite_output_dir and old_checkpoints:
        # Keep-last-N ranks checkpoints by step: an old checkpoint-1000 would outrank (and so delete) this run's
        # checkpoint-200, and `resume auto` would later pick the old run. Nothing is deleted on the user's behalf.
        raise UsageError(f"output_dir {output_dir} holds checkpoints of an earlier run ({', '.join(old_checkpoints[:3])}"
                         f"{', ...' if len(old_checkpoints) > 3 else ''}): --overwrite_output_dir overwrites files but "
                         "does not mix checkpoints of two runs. Move or delete them, or choose another output_dir")


def _same_run_on_every_node(output_dir: Path, args) -> None:
    """On node-local disks: every node's copy of output_dir holds this run (node 0's run id) or none yet."""
    ids = gather_from_ranks({"rank": args.process_index, "id": ckpt.read_run_id(output_dir)})
    other = [r for r in ids if r["id"] not in (None, ids[0]["id"])]
    if other:
        raise UsageError(f"output_dir {output_dir} holds another run on the node of rank {other[0]['rank']} "
                         "than on node 0 (its hf_zero3_run.json differs): on each node's own disk, output_dir must "
                         "hold the same run everywhere, or nothing yet. Choose another output_dir, or move that "
                         "node's copy aside")


def claim(args) -> None:
    """Rank 0 records that a run owns output_dir (so its unfinished saves can be told from anyone else's) and
    that it is not finished; on node-local disks each node's first rank writes the same run id into its copy. The
    other ranks wait for it."""
    barrier()  # every rank has looked at output_dir before rank 0 writes into it
    run_id = ckpt.claim_output_dir(args.output_dir) if is_world_process_zero() else None
    run_id = gather_from_ranks({"id": run_id})[0]["id"]
    if args.should_save:
        if not is_world_process_zero():
            ckpt.claim_output_dir(args.output_dir, run_id)
        ckpt.clear_finished(args.output_dir)
    barrier()
