"""At each complete save, push the exported weights (never the optimizer shards) to the Hub with a model card."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.checkpoint import CheckpointError, is_complete


class HubPushCallback(TrainerCallback):
    """Export each complete checkpoint (`hf_zero3.export`) on rank 0 and upload it (`hf_zero3.hub`).

    Why: the Trainer's own `push_to_hub` uploads what it saved, which under ZeRO-3 without 16-bit gathering is
    an empty state dict; and a push of a half-written checkpoint is worse than none. This pushes only
    checkpoints that CheckpointGuardCallback marked complete (it must come first in the callback list), as a
    plain HF folder whose weights were checked.

    Rank 0 exports right after the save (local files only, while the checkpoint surely exists), then uploads
    in a background thread: an upload can outlast the collective timeout, so the other ranks must not wait for
    it. A save that comes while the previous upload still runs is skipped (one at a time); the end of training
    waits for the running upload, then pushes the last skipped checkpoint. A failed export or upload is
    reported and training goes on.

    Args:
        repo_id: ORG/NAME on the Hub.
        private: create the repo private (only when it does not exist yet).
        revision: branch to push to (default: main).
        dtype: weights dtype, "bf16" or "fp32".
        max_shard_size: safetensors shard size, e.g. "5GB".
    """

    def __init__(self, repo_id: str, private: bool = False, revision: str | None = None, dtype: str = "bf16",
                 max_shard_size: str = "5GB"):
        if not repo_id or "/" not in repo_id:
            raise CheckpointError(f"hub repo id {repo_id!r}: set hub_model_id to ORG/NAME")
        self.repo_id, self.private, self.revision = repo_id, private, revision
        self.dtype, self.max_shard_size = dtype, max_shard_size
        self._worker: threading.Thread | None = None
        self._skipped: Path | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.hub_token:
            raise CheckpointError("hub_token is set in TrainingArguments, which the Trainer pickles into "
                                  "training_args.bin of every checkpoint: remove it and provide the token with "
                                  "HF_TOKEN or `hf auth login`")
        for stale in Path(args.output_dir).glob(".hub-export-*") if state.is_world_process_zero else []:
            shutil.rmtree(stale, ignore_errors=True)  # an export left behind by a run that was killed

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not state.is_world_process_zero:
            return
        if not is_complete(folder):
            print(f"hf_zero3: not pushing {folder}: it has no completion marker (is CheckpointGuardCallback "
                  "installed before HubPushCallback?)", flush=True)
        elif self._worker is not None and self._worker.is_alive():
            print(f"hf_zero3: the previous upload is still running; {folder.name} is not pushed now", flush=True)
            self._skipped = folder
        elif (staged := self._export(folder)) is not None:
            self._skipped = None
            self._worker = threading.Thread(target=self._upload, args=staged, name="hf_zero3-hub-push")
            self._worker.start()

    def on_train_end(self, args, state, control, **kwargs):
        if self._worker is not None:
            self._worker.join()
        if self._skipped is not None and is_complete(self._skipped) and (staged := self._export(self._skipped)):
            self._upload(*staged)

    def _export(self, folder: Path) -> tuple[Path, Path] | None:
        """Export now (the checkpoint may be rotated away later) into a staging folder the upload then owns."""
        from hf_zero3.export import export_checkpoint

        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".hub-export-"))
        try:
            return export_checkpoint(folder, staging / folder.name, self.dtype, self.max_shard_size), staging
        except Exception as e:  # the run must not die for the upload
            shutil.rmtree(staging)
            print(f"hf_zero3: WARNING: exporting {folder.name} for the Hub failed ({type(e).__name__}: {e}); "
                  "training goes on", flush=True)
            return None

    def _upload(self, out: Path, staging: Path) -> None:
        from hf_zero3.hub import push_folder

        try:
            url = push_folder(out, self.repo_id, self.private, self.revision,
                              commit_message=f"{out.name} (step {out.name.split('-')[-1]})")
            print(f"hf_zero3: pushed {out.name} to {self.repo_id}: {url}", flush=True)
        except Exception as e:  # network, auth, quota: the run must not die for the upload
            print(f"hf_zero3: WARNING: pushing {out.name} to {self.repo_id} failed ({type(e).__name__}: {e}); "
                  "training goes on, the next save pushes again", flush=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
