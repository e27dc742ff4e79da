"""After every save: verify the checkpoint on all ranks, mark it complete, keep the newest N complete ones."""

from __future__ import annotations

import platform
import shutil
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3 import __version__, recipes
from hf_zero3.callbacks._console import say
from hf_zero3.checkpoint import contents, folders
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.plan.hardware import gpu_name, versions
from hf_zero3.plan.saves import SaveSize, save_size
from hf_zero3.job.distributed import fail_together, gather_from_ranks, local_world_size
from hf_zero3.job.facts import ds_config_of
from hf_zero3.job.storage import node_writer


class CheckpointGuardCallback(TrainerCallback):
    """Make `checkpoint-N` count only once every rank's part is verified; rotate over complete checkpoints.

    Why: the Trainer's save has no notion of "finished": a kill or a full disk mid-save leaves a folder that
    `get_last_checkpoint` happily resumes from, and its rotation counts such folders and may delete the newest
    good checkpoint. Here, after each save, every rank checks its own DeepSpeed shards and RNG state, rank 0
    checks `latest`, the trainer state and the gathered 16-bit weights, and only then writes
    `hf_zero3_complete.json` (see `hf_zero3.checkpoint.lifecycle`). Before a save, every rank checks that the disk can
    hold one more checkpoint, so a full disk is a clear error instead of a half-written folder; a save that
    fails anyway (the disk filled up meanwhile) ends with a note that names the cause and the way back. When
    training starts, the size of the first save is estimated from the model (`hf_zero3.plan.saves`): a disk
    that cannot hold it is an error then, not hours later; one that cannot hold the newest N while the next is
    written is a warning.

    Args:
        save_total_limit: complete checkpoints to keep (None: keep all). Set it here and leave
            `TrainingArguments.save_total_limit` at None: the Trainer's own rotation counts incomplete folders.
        space_margin: free space wanted before a save, as a multiple of the newest complete checkpoint's size.
        sources: what the run started from, recorded for the model card: `base_model` (the pretrained weights'
            folder or hub id) and `datasets` (hub dataset ids).
    """

    def __init__(self, save_total_limit: int | None = None, space_margin: float = 1.05, sources: dict | None = None):
        self.save_total_limit = save_total_limit
        self.space_margin = space_margin
        self.sources = sources or {}
        self._first_step = 0  # of this run (a resumed run starts later): the throughput it measured
        self._saving: Path | None = None  # the checkpoint being written, between on_step_end and on_save
        self._previous_hook = None
        self._first_save_bytes = 0  # estimated for this rank's node, until a complete checkpoint measures it
        self._training = False
        self._foreseen = False  # the save flagged in on_evaluate (save_strategy "best"), not yet made

    def on_train_begin(self, args, state, control, **kwargs):
        if args.save_total_limit is not None:
            raise ckpt.CheckpointError(
                f"TrainingArguments.save_total_limit={args.save_total_limit} would let the Trainer delete "
                "checkpoints by folder name, complete or not: set it to None and pass "
                "CheckpointGuardCallback(save_total_limit=...) instead (hf-zero3 train does this for you)")
        run_id = ckpt.claim_output_dir(args.output_dir) if state.is_world_process_zero else None
        run_id = gather_from_ranks({"id": run_id})[0]["id"]  # our saves carry its run id: only they are ever deleted
        if args.should_save and not state.is_world_process_zero:  # a node's own copy (save_on_each_node)
            ckpt.claim_output_dir(args.output_dir, run_id)
        gather_from_ranks({})  # the claims are on disk before any rank classifies folders
        every = state.save_steps if args.save_strategy == "steps" and state.save_steps else None
        mine = [] if args.save_strategy == "no" else folders.save_collisions(
            args.output_dir, state.global_step, state.max_steps, every)
        collisions = [line for record in gather_from_ranks({"c": [f"{f.path}: {f.why}" for f in mine]})
                      for line in record["c"]]
        if collisions:
            raise ckpt.CheckpointError(
                f"this run would save into folders that are not its to overwrite: {sorted(set(collisions))}. Nothing "
                "was written; move them out of output_dir and run again")
        if kwargs.get("model") is not None:
            self._check_space(args, state, *_save_sizes(args, kwargs["model"]))
        self._first_step = state.global_step
        self._previous_hook = sys.excepthook
        sys.excepthook = lambda *exc: self._explain_failed_save(args, *exc)
        self._training = True

    def on_train_end(self, args, state, control, **kwargs):
        self._training = False
        self.on_step_begin(args, state, control)  # a "best" save flagged at the last evaluation but not made
        if self._previous_hook is not None:
            sys.excepthook, self._previous_hook = self._previous_hook, None

    def _check_space(self, args, state, checkpoint: SaveSize, final: SaveSize) -> None:
        """Every rank: its node's disk holds the first save (else an error before any step) and, as a warning,
        the checkpoints this run keeps at once (the newest `save_total_limit` while the next is written) plus the
        final model."""
        saves = args.save_strategy != "no"
        final_too = bool(getattr(args, "save_final_model", True))
        if not saves and not final_too:
            return
        local = local_world_size(args.world_size)
        node0 = args.process_index == args.local_process_index  # rank 0's node also gets the whole-model files
        on_node = lambda size: size.on_node(local, args.world_size, node0)  # noqa: E731
        first = on_node(checkpoint if saves else final)
        new = self._new_checkpoints(args, state) if saves else 0
        if saves and self.save_total_limit:
            new = max(1, min(new, self.save_total_limit + 1 - len(ckpt.complete_checkpoints(args.output_dir))))
        most = new * on_node(checkpoint) + (on_node(final) if final_too else 0)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(args.output_dir).free
        records = gather_from_ranks({"rank": args.process_index, "free": free, "first": first, "most": most})
        if short := [r for r in records if r["free"] < r["first"]]:
            r = min(short, key=lambda r: r["free"] - r["first"])
            shards = (" ZeRO-3 without 16-bit gathering saves ZeRO shards: the fp32 weights and the optimizer's "
                      "moments, 12 B per parameter with Adam." if checkpoint.sharded and not checkpoint.whole else "")
            raise ckpt.CheckpointError(
                f"the disk of {args.output_dir} (rank {r['rank']}) has {r['free'] / 1e9:.1f} GB free, but "
                f"{'the first checkpoint' if saves else 'the final model'} of this model takes about "
                f"{r['first'] / 1e9:.1f} GB "
                f"there, so that save would fail.{shards} Nothing was written: put output_dir on a larger disk (or "
                "free space), then run the same command")
        self._first_save_bytes = first
        if state.is_world_process_zero:
            say(f"hf_zero3: a checkpoint of this model takes about {_size(checkpoint.total)}, the final model "
                f"{_size(final.total)} (estimated); {_size(free)} free under {args.output_dir}")
        worst = min(records, key=lambda r: r["free"] - r["most"])
        if state.is_world_process_zero and worst["free"] < worst["most"]:
            say(f"hf_zero3: warning: the disk of {args.output_dir} has {_size(worst['free'])} free, but this run "
                f"writes {new} more checkpoint(s) of about {_size(checkpoint.total)} that are on disk at once "
                f"(save_total_limit={self.save_total_limit}, while the next is written)"
                + (f" and a final model of {_size(final.total)}" if final_too else "")
                + f", about {_size(worst['most'])}: a later save will stop the run with a disk-full error. "
                "Lower save_total_limit, or put output_dir on a larger disk")

    @staticmethod
    def _new_checkpoints(args, state) -> int:
        """How many checkpoints this run will write (1 when the schedule does not say: steps unknown, epochs)."""
        if args.save_strategy == "steps" and state.save_steps and state.max_steps > 0:
            return max(1, (state.max_steps - state.global_step) // state.save_steps)
        return 1

    def _explain_failed_save(self, args, exc_type, exc, tb) -> None:
        """torch.save reports a full disk as "iostream error" / "unexpected pos": say what happened, what now."""
        self._previous_hook(exc_type, exc, tb)
        if self._saving is None:
            return
        newest = ckpt.newest_complete(args.output_dir)
        need = (ckpt.read_marker(newest) or {}).get("bytes", 0) if newest else self._first_save_bytes
        free = shutil.disk_usage(self._saving if self._saving.exists() else args.output_dir).free
        cause = (f"the disk is full ({free / 1e6:.1f} MB free, a checkpoint takes {need / 1e6:.1f} MB)"
                 if free < need else f"{exc_type.__name__}, {free / 1e6:.1f} MB free on its disk")
        print(f"hf_zero3: rank {args.process_index}: saving {self._saving} failed: {cause}. It has no completion "
              f"marker; --resume_from_checkpoint auto removes it and resumes from {newest}. Fix the cause, then "
              "resume.", file=sys.stderr, flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._before_save(args, state)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """save_strategy "best": the Trainer decides to save after evaluating, past on_step_end; the same test
        (`Trainer._determine_best_metric`) tells here whether it will."""
        if self._training and args.save_strategy == "best" and _new_best(args, state, metrics or {}):
            self._before_save(args, state)
            self._foreseen = True

    def on_step_begin(self, args, state, control, **kwargs):
        """A save foreseen in on_evaluate that the Trainer did not make: drop the folder that holds only the flag."""
        if self._foreseen and self._saving is not None:
            if state.is_world_process_zero and self._saving.is_dir() \
                    and [p.name for p in self._saving.iterdir()] == [ckpt.SAVING]:
                ckpt.remove_checkpoint(self._saving)
            self._saving = None
        self._foreseen = False

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._before_save(args, state)

    def _before_save(self, args, state) -> None:
        folder = ckpt.checkpoint_dir(args.output_dir, state.global_step)
        there = folders.classify(folder, ckpt.read_run_id(args.output_dir)) if folder.exists() else None
        newest = ckpt.newest_complete(args.output_dir)
        need = int(((ckpt.read_marker(newest) or {}).get("bytes", 0) if newest else self._first_save_bytes)
                   * self.space_margin)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(args.output_dir).free
        taken = there is not None and there.kind not in ("unfinished", "empty")
        short = gather_from_ranks({"rank": args.process_index, "free": free, "short": free < need, "taken": taken})
        if any(r["taken"] for r in short):  # never write into (or mark as ours) a folder we did not start
            why = there.why if there is not None else "as another rank sees it"
            raise ckpt.CheckpointError(
                f"{folder} already exists and is not this run's unfinished save ({why}): nothing was written. Move it "
                f"out of output_dir, then resume with --resume_from_checkpoint auto (newest complete: {newest})")
        if any(r["short"] for r in short):
            worst = min(r["free"] for r in short)
            raise ckpt.CheckpointError(
                f"disk full: checkpoint-{state.global_step} needs about {need / 1e9:.3f} GB but only "
                f"{worst / 1e9:.3f} GB is free under {args.output_dir}. Nothing was written; the newest complete "
                f"checkpoint is {newest}. Free space (or lower save_total_limit, or move output_dir), then resume "
                "with --resume_from_checkpoint auto")
        unwritable = None
        if args.should_save:  # only after every rank looked at the folder: none sees a half-made flag
            try:
                if there is not None and there.kind == "unfinished":  # our own killed attempt at this step
                    ckpt.remove_checkpoint(folder)
                ckpt.mark_saving(folder)
            except OSError as e:  # read-only filesystem, permissions: say so on every rank, write nothing more
                unwritable = str(e)
        if errors := [r["unwritable"] for r in gather_from_ranks({"unwritable": unwritable}) if r["unwritable"]]:
            raise ckpt.CheckpointError(
                f"cannot write {folder}: {errors[0]}. Nothing of the save was written; the newest complete checkpoint "
                f"is {newest}. Make {args.output_dir} writable (or move output_dir), then resume with "
                "--resume_from_checkpoint auto")
        self._saving = folder

    def on_save(self, args, state, control, **kwargs):
        folder = ckpt.checkpoint_dir(args.output_dir, state.global_step)
        writer = node_writer(args)
        if args.save_on_each_node and args.deepspeed and args.world_size > 1:
            _latest_on_each_node(folder, args, state)
        problems = contents.verify_rank_files(folder, args.process_index, args.world_size, bool(args.deepspeed))
        if args.should_save:  # the 16-bit weights: gathered on rank 0 alone, so on node 0 only (save_on_each_node)
            problems += contents.verify_shared_files(
                folder, weights=_gathers_weights(args) and state.is_world_process_zero)
        # each rank hashes the files it wrote (still in its page cache), all ranks at once
        hashes = ckpt.hash_files(folder, args.process_index, args.world_size, writer) if not problems else {}
        records = gather_from_ranks({"problems": problems, "hashes": hashes, "writer": writer})
        problems = [p for record in records for p in record["problems"]]
        if problems:
            raise ckpt.CheckpointError(
                f"{folder} is incomplete: {'; '.join(problems)}. It has no completion marker, so it is never "
                f"resumed from; the newest complete checkpoint is {ckpt.newest_complete(args.output_dir)}")
        self._saving, self._foreseen = None, False
        unwritten = None
        if args.should_save:  # rank 0; on node-local disks each node's first rank, for its node's copy
            try:
                ckpt.write_marker(folder, {**_provenance(args, state, self._first_step), "sources": self.sources,
                                           "run_id": ckpt.read_run_id(args.output_dir)},
                                  hashes={k: v for record in records if record["writer"] == writer
                                          for k, v in record["hashes"].items()})
            except OSError as e:
                unwritten = f"rank {args.process_index}: its completion marker could not be written ({e})"
        fail_together(unwritten, ckpt.CheckpointError)  # every copy is marked before any rotation deletes one
        everywhere = None
        if args.save_on_each_node and args.world_size > 1:  # keep-last-N counts what is complete on every node
            mine = sorted(ckpt.checkpoint_step(p) for p in ckpt.complete_checkpoints(args.output_dir))
            everywhere = set.intersection(*(set(r["steps"]) for r in gather_from_ranks({"steps": mine})))
        if not args.should_save:
            return
        for old in folders.rotate(args.output_dir, self.save_total_limit, protect=state.best_model_checkpoint,
                                  everywhere=everywhere):
            say(f"hf_zero3: deleted {old} (keeping the newest {self.save_total_limit} complete)")


def _latest_on_each_node(folder: Path, args, state) -> None:
    """DeepSpeed writes its `latest` tag on global rank 0 only, even with use_node_local_storage; every rank reads
    it to resume. On node-local disks (save_on_each_node) each node's first rank writes rank 0's tag into its copy."""
    tag = None
    if state.is_world_process_zero:
        try:
            tag = (folder / "latest").read_text().strip()
        except OSError:
            tag = None  # verify_rank_files reports it
    tag = gather_from_ranks({"tag": tag})[0]["tag"]
    if tag and args.should_save and not (folder / "latest").is_file():
        tmp = folder / ".latest.tmp"
        tmp.write_text(tag)
        tmp.replace(folder / "latest")


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _new_best(args, state, metrics: dict) -> bool:
    """Whether `metrics` beat `state.best_metric` as the Trainer judges it (`metric_for_best_model`; no best yet:
    anything finite beats it; NaN never does)."""
    name = args.metric_for_best_model or "loss"
    value = metrics.get(name if name.startswith("eval_") else f"eval_{name}")
    if value is None:
        return False
    best = state.best_metric
    if best is None:
        best = float("-inf") if args.greater_is_better else float("inf")
    return value > best if args.greater_is_better else value < best


def _save_sizes(args, model) -> tuple[SaveSize, SaveSize]:
    """(a checkpoint, the final model) of this run's model, estimated (ZeRO-3 parameters count whole). A peft model
    saves only what trains (its adapter, always gathered): the Trainer leaves the frozen base out of both."""
    peft = hasattr(model, "peft_config")
    params = [p for p in model.parameters() if p.requires_grad or not peft]
    count = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    ds = ds_config_of(args)
    optimizer = ((ds or {}).get("optimizer") or {}).get("type") or getattr(args.optim, "value", str(args.optim))
    return save_size(count, params[0].element_size() if params else 0, ds, optimizer, peft or _gathers_weights(args))


def _gathers_weights(args) -> bool:
    """The Trainer writes full weights unless ZeRO-3 runs with 16-bit gathering off."""
    return not args.deepspeed or ckpt.weights_gathered(ds_config_of(args))


def _hardware(args) -> dict:
    device = gpu_name() or f"CPU {platform.machine()} {platform.processor() or ''}".strip()
    return {"ranks": args.world_size, "device": device}


def _recipe(args) -> dict:
    recipe = recipes.of_ds_config(args.deepspeed)
    return {"name": recipe.name, "version": recipe.version} if recipe else {}


def _provenance(args, state, first_step: int) -> dict:
    """What wrote this checkpoint: for resume checks (world size) and for the model card."""
    import json

    # ThroughputCallback's figures (eval and save time excluded), not a second timer of our own
    timed = [r for r in state.log_history if "samples_per_s" in r and "step_time_s" in r and r["step"] > first_step]
    losses = [r["loss"] for r in state.log_history if "loss" in r]
    return {
        "world_size": args.world_size,
        "weights_16bit": _gathers_weights(args),
        "hf_zero3_version": __version__,
        "versions": versions(),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hardware": _hardware(args),
        "recipe": _recipe(args),
        "loss": losses[-1] if losses else None,
        "throughput": {"samples_per_second": sum(r["samples_per_s"] for r in timed) / len(timed),
                       "steps_per_second": len(timed) / sum(r["step_time_s"] for r in timed),
                       "measured_over_steps": state.global_step - first_step} if timed else None,
        "ds_config": ds_config_of(args),
        "training_args": json.loads(args.to_json_string()),  # to_dict masks every *_token field
    }
