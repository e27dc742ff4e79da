"""At each complete save, push the exported weights (never the optimizer shards) to the Hub with a model card."""

from __future__ import annotations

import tempfile
from pathlib import Path

from transformers import TrainerCallback

from hf_zero3.checkpoint import CheckpointError, is_complete


class HubPushCallback(TrainerCallback):
    """Export each complete checkpoint (`hf_zero3.export`) on rank 0 and upload it (`hf_zero3.hub`).

    Why: the Trainer's own `push_to_hub` uploads what it saved, which under ZeRO-3 without 16-bit gathering is
    an empty state dict; and a push of a half-written checkpoint is worse than none. This pushes only
    checkpoints that CheckpointGuardCallback marked complete (it must come first in the callback list), as a
    plain HF folder whose weights were checked. Training waits for the upload; a failed upload is reported
    and training goes on (the next save pushes again).

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

    def on_train_begin(self, args, state, control, **kwargs):
        if args.hub_token:
            raise CheckpointError("hub_token is set in TrainingArguments, which the Trainer pickles into "
                                  "training_args.bin of every checkpoint: remove it and provide the token with "
                                  "HF_TOKEN or `hf auth login`")

    def on_save(self, args, state, control, **kwargs):
        from hf_zero3.export import export_checkpoint
        from hf_zero3.hub import push_folder

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not state.is_world_process_zero:
            return
        if not is_complete(folder):
            print(f"hf_zero3: not pushing {folder}: it has no completion marker (is CheckpointGuardCallback "
                  "installed before HubPushCallback?)", flush=True)
            return
        with tempfile.TemporaryDirectory(dir=args.output_dir, prefix=".hub-export-") as staging:
            out = export_checkpoint(folder, Path(staging) / folder.name, self.dtype, self.max_shard_size)
            try:
                url = push_folder(out, self.repo_id, self.private, self.revision,
                                  commit_message=f"{folder.name} (step {state.global_step})")
            except Exception as e:  # network, auth, quota: the run must not die for the upload
                print(f"hf_zero3: WARNING: pushing {folder.name} to {self.repo_id} failed "
                      f"({type(e).__name__}: {e}); training goes on, the next save pushes again", flush=True)
                return
        print(f"hf_zero3: pushed {folder.name} to {self.repo_id}: {url}", flush=True)
