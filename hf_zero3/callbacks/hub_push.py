"""At each complete save, push the exported weights (never the optimizer shards) to the Hub with a model card."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.callbacks._console import say
from hf_zero3.checkpoint import export, hub
from hf_zero3.checkpoint.lifecycle import CheckpointError, checkpoint_dir, is_complete

STAGING_PREFIX = ".hub-export-"
"""Staging folders in output_dir: `.hub-export-XXXX/source/RUN/checkpoint-N` (the hard-link snapshot) and
`.hub-export-XXXX/checkpoint-N` (the export that is uploaded). Not named `checkpoint-*`: rotation, resume and
the guard's disk check never count them."""
STAGING_OWNER = "hf_zero3_staging"
"""Written into each staging folder as it is made: only folders holding it are ours to remove after a killed run."""


def snapshot_checkpoint(folder: str | os.PathLike, into: str | os.PathLike) -> Path:
    """Hard-link every file of `folder` into `into` (same tree); returns `into`. Raises OSError where it cannot.

    The snapshot shares the files' data with the checkpoint: it takes no disk space of its own, costs one
    metadata operation per file, and stays whole when the checkpoint is deleted (rotation unlinks names, the
    data goes when its last link does). That is sound because nothing rewrites a saved checkpoint's files in
    place: each save writes a new `checkpoint-N` folder, and our marker is replaced, never edited. The
    snapshot must also pass `is_complete` (every file the marker lists, with its size): a tree that could not
    be linked whole (a file that vanished, a linked folder) is an error, never a partial export.
    """
    folder, into = Path(folder), Path(into)
    for root, _, files in os.walk(folder):
        target = into / Path(root).relative_to(folder)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.link(Path(root) / name, target / name)
    if not is_complete(into):
        raise OSError(f"the hard-link snapshot of {folder.name} is not complete (a file vanished or is not a "
                      "plain file)")
    return into


class HubPushCallback(TrainerCallback):
    """Export each complete checkpoint (`hf_zero3.checkpoint.export`) on rank 0 and upload it (`hf_zero3.checkpoint.hub`).

    Why: the Trainer's own `push_to_hub` uploads what it saved, which under ZeRO-3 without 16-bit gathering is
    an empty state dict; and a push of a half-written checkpoint is worse than none. This pushes only
    checkpoints that CheckpointGuardCallback marked complete (it must come first in the callback list), as a
    plain HF folder whose weights were checked.

    Why in the background, export included: the export reads every optimizer shard and writes the weights
    (for 70B, ~840 GB read and ~140 GB written); done inside on_save it holds rank 0 while the other ranks
    wait in the next step's collectives, past the collective timeout (`ddp_timeout`, 30 min by default) for a
    large model. So on_save only takes a snapshot of the checkpoint by hard links (`snapshot_checkpoint`,
    milliseconds) into `output_dir/.hub-export-XXXX/`, and a thread exports from the snapshot, uploads, and
    removes the staging folder. Keep-last-N may delete the checkpoint meanwhile: the snapshot keeps its
    data, so the export never reads a half-deleted checkpoint. Where hard links are impossible (output_dir on
    a filesystem without them, a checkpoint symlinked to another disk) rank 0 says so and exports at once,
    before training goes on, as before; only the upload then runs in the thread.

    One push at a time: a save that comes while the thread runs is skipped, but snapshotted at once (it may be
    rotated away before the end), replacing the previous skipped one; the end of training waits for the
    thread, then pushes the last skipped checkpoint. A failed export or upload is reported and training goes
    on. Staging folders of a run that was killed are removed when training begins.

    Disk: linked files take no space, so the guard's free-space check before each save (which measures the
    disk, and sizes the next save from the newest `checkpoint-N` marker, never from a staging folder) stays
    right. What changes is when space comes back: a checkpoint that rotation deleted while its snapshot is
    exporting (or waits as the skipped one) frees its space only when the snapshot goes, so allow for up to
    two checkpoints beyond `save_total_limit`, plus the export itself. The snapshot is dropped as soon as its
    export is written, before the upload.

    Args:
        repo_id: ORG/NAME on the Hub.
        private: create the repo private (only when it does not exist yet).
        revision: branch to push to (default: main).
        dtype: weights dtype, "bf16" or "fp32".
        max_shard_size: safetensors shard size, e.g. "5GB".
    """

    def __init__(self, repo_id: str, private: bool = False, revision: str | None = None, dtype: str = "bf16",
                 max_shard_size: str = "5GB"):
        hub.check_repo_id(repo_id, "hub_model_id")
        self.repo_id, self.private, self.revision = repo_id, private, revision
        self.dtype, self.max_shard_size = dtype, max_shard_size
        self._worker: threading.Thread | None = None
        self._pushing: Path | None = None  # the checkpoint the worker pushes
        self._skipped: tuple[Path, Path, Path] | None = None  # (checkpoint, what to export from, staging folder)

    def on_train_begin(self, args, state, control, **kwargs):
        if args.hub_token:
            raise CheckpointError("hub_token is set in TrainingArguments, which the Trainer pickles into "
                                  "training_args.bin of every checkpoint: remove it and provide the token with "
                                  "HF_TOKEN or `hf auth login`")
        for stale in Path(args.output_dir).glob(f"{STAGING_PREFIX}*") if state.is_world_process_zero else []:
            if (stale / STAGING_OWNER).is_file():
                shutil.rmtree(stale, ignore_errors=True)  # an export left behind by a run that was killed
            else:
                say(f"hf_zero3: {stale} looks like a push staging folder but has no {STAGING_OWNER} file (not made "
                    "by this hf-zero3, or by one older than the owner file): left in place; if it is a leftover "
                    "push, delete it yourself: its hard links keep deleted checkpoints' disk space in use")

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save and state.is_world_process_zero:
            self._before_save(checkpoint_dir(args.output_dir, state.global_step))

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save and state.is_world_process_zero:
            self._before_save(checkpoint_dir(args.output_dir, state.global_step))

    def _before_save(self, folder: Path) -> None:
        """A save into a folder we hold a snapshot of would rewrite the linked files in place (torch.save opens
        with "wb"). The Trainer never saves one step twice, so this does not happen; if it ever does, the
        snapshot goes first: the skipped one is dropped (the new save is snapshotted again), a running export
        is waited for."""
        if self._skipped is not None and self._skipped[0] == folder:
            shutil.rmtree(self._skipped[2], ignore_errors=True)
            self._skipped = None
        if self._pushing == folder and self._worker is not None and self._worker.is_alive():
            self._worker.join()

    def on_save(self, args, state, control, **kwargs):
        folder = checkpoint_dir(args.output_dir, state.global_step)
        if not state.is_world_process_zero:
            return
        if not is_complete(folder):
            print(f"hf_zero3: not pushing {folder}: it has no completion marker (is CheckpointGuardCallback "
                  "installed before HubPushCallback?)", flush=True)
            return
        busy = self._worker is not None and self._worker.is_alive()
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=STAGING_PREFIX))
        (staging / STAGING_OWNER).write_text("hf-zero3 push staging: removed when its push ends\n")
        source = self._snapshot(folder, staging)
        if busy:
            say(f"hf_zero3: the previous push is still running; {folder.name} is not pushed now (the end of "
                "training pushes the last one skipped)")
            self._drop_skipped()
            self._skipped = (folder, source or folder, staging)
        elif source is not None:
            self._drop_skipped()
            self._start(folder, source, staging, None)
        elif (out := self._export(folder, staging)) is not None:  # no snapshot: export now, while it exists
            self._drop_skipped()
            self._start(folder, folder, staging, out)
        else:
            shutil.rmtree(staging, ignore_errors=True)

    def on_train_end(self, args, state, control, **kwargs):
        """Hand what is left (the running push, then the last skipped checkpoint) to a thread: rank 0 must not
        hold up the collectives after training (the final save_model gathers ZeRO-3 weights on all ranks).
        `wait()` joins it; Python joins it at exit in any case (it is not a daemon)."""
        if self._worker is None and self._skipped is None:
            return
        running, skipped, self._skipped = self._worker, self._skipped, None
        self._worker = threading.Thread(target=self._finish, args=(running, skipped), name="hf_zero3-hub-push")
        self._worker.start()

    def wait(self) -> None:
        """Block until every push has ended (train.py calls it once the run's collectives are done)."""
        if self._worker is not None:
            self._worker.join()

    def _finish(self, running: threading.Thread | None, skipped: tuple[Path, Path, Path] | None) -> None:
        if running is not None:
            running.join()
        if skipped is not None:
            folder, source, staging = skipped
            if is_complete(source):
                self._push(source, staging)
            else:  # only without a snapshot: rotation deleted it
                shutil.rmtree(staging, ignore_errors=True)
                print(f"hf_zero3: not pushing {folder.name}: it was deleted (keep-last-N) before the end of "
                      "training", flush=True)

    def _snapshot(self, folder: Path, staging: Path) -> Path | None:
        """The hard-link snapshot of `folder` in `staging`, or None (said why) where links are impossible."""
        into = staging / "source" / folder.absolute().parent.name / folder.name  # card title: RUN / checkpoint-N
        try:
            return snapshot_checkpoint(folder, into)
        except OSError as e:  # EXDEV (another disk), EPERM / ENOTSUP (no hard links on this filesystem)
            shutil.rmtree(staging / "source", ignore_errors=True)
            print(f"hf_zero3: cannot hard-link {folder.name} into {staging.parent} ({type(e).__name__}: {e}); "
                  "it is exported from the checkpoint itself, on the training path (the other ranks wait)", flush=True)
            return None

    def _drop_skipped(self) -> None:
        if self._skipped is not None:
            shutil.rmtree(self._skipped[2], ignore_errors=True)
            self._skipped = None

    def _start(self, folder: Path, source: Path, staging: Path, exported: Path | None) -> None:
        self._pushing = folder
        self._worker = threading.Thread(target=self._push, args=(source, staging, exported),
                                        name="hf_zero3-hub-push")
        self._worker.start()

    def _push(self, source: Path, staging: Path, exported: Path | None = None) -> None:
        """Export `source` (unless done already) and upload it; the staging folder goes in any case."""
        try:
            out = exported or self._export(source, staging)
            shutil.rmtree(staging / "source", ignore_errors=True)  # the snapshot: its space back before the upload
            if out is not None:
                self._upload(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _export(self, source: Path, staging: Path) -> Path | None:
        """`staging/checkpoint-N`, exported from `source` (the checkpoint or its snapshot); None if that failed."""
        try:
            return export.export_checkpoint(source, staging / source.name, self.dtype, self.max_shard_size)
        except Exception as e:  # noqa: BLE001 -- the run must not die for the upload
            print(f"hf_zero3: WARNING: exporting {source.name} for the Hub failed ({type(e).__name__}: {e}); "
                  "training goes on", flush=True)
            return None

    def _upload(self, out: Path) -> None:
        try:
            url = hub.push_folder(out, self.repo_id, self.private, self.revision,
                              commit_message=f"{out.name} (step {out.name.split('-')[-1]})")
            say(f"hf_zero3: pushed {out.name} to {self.repo_id}: {url}")
        except Exception as e:  # noqa: BLE001 -- network, auth, quota: the run must not die for it
            say(f"hf_zero3: WARNING: pushing {out.name} to {self.repo_id} failed ({type(e).__name__}: {e}); "
                "training goes on, the next save pushes again")
