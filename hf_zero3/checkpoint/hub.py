"""Push an exported model folder (with its model card, `hf_zero3.checkpoint.card`) to the Hugging Face Hub.

Why: the stock `push_to_hub` uploads whatever the Trainer saved, which under ZeRO-3 without 16-bit gathering
is an empty state dict. We push only an exported folder (`hf_zero3.checkpoint.export`) whose weights were checked, and
only its model files. The token is never ours to handle: huggingface_hub reads `HF_TOKEN` or the
`hf auth login` file itself; we never pass, print, log or write it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

from hf_zero3.checkpoint.contents import ADAPTER_CONFIG, holds_adapter, verify_weights
from hf_zero3.checkpoint.lifecycle import CheckpointError

PUSHED = ["*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json", ADAPTER_CONFIG,
          "tokenizer*",
          "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*", "README.md"]
"""What a push uploads from the folder: model files and the card, never optimizer or RNG state."""
STALE_WEIGHTS = ["model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"]
"""The model weights (the names `hf-zero3 export` writes) already in the repo that a push removes unless it uploads
them again (`upload_folder` only adds); other files there, an adapter's weights say, are the user's and stay.
An adapter push replaces the adapter's files and leaves model weights alone."""


def check_repo_id(repo_id: str | None, setting: str = "repo id") -> str:
    """`repo_id` if it is ORG/NAME as the Hub takes it, else CheckpointError naming `setting` and the form.

    Checked before anything is exported or uploaded: huggingface_hub would fail only then, and a bare NAME it
    would quietly put under the token's user."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        if not isinstance(repo_id, str) or repo_id.count("/") != 1:
            raise HFValidationError("not ORG/NAME")
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CheckpointError(f"{setting} {repo_id!r} is not ORG/NAME: set {setting} to ORG/NAME, e.g. "
                              "my-org/llama-8b-sft (one `/` between user or organization and model name; letters, "
                              "digits, '-', '_', '.', not at either end, no '--' or '..'; 96 characters at most)"
                              ) from None
    return repo_id


def _kinds(e: BaseException) -> set[str]:
    """The class names of `e` and its bases: the HTTP library (httpx or a fork) is matched by name, not imported."""
    return {cls.__name__ for cls in type(e).__mro__}


def _push_error(e: Exception, repo_id: str) -> CheckpointError:
    """A push failure as a one-line error that names the fix (never the token: it is in no message we quote)."""
    import socket

    from huggingface_hub import constants
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    causes, cause = [], e
    while cause is not None and len(causes) < 10:  # the HTTP library's error wraps the socket's
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    where = f"the Hub at {constants.ENDPOINT}"
    org = repo_id.split("/")[0]
    status = e.response.status_code if isinstance(e, HfHubHTTPError) and e.response is not None else None
    if isinstance(e, RepositoryNotFoundError):
        return CheckpointError(f"{where} has no repo {repo_id} that this token can see (HTTP {status}): check the repo "
                               f"id, and that HF_TOKEN (or `hf auth login`) is a token of {org} with write access")
    if isinstance(e, LocalTokenNotFoundError) or status == 401:
        return CheckpointError(f"{where} refused the request as unauthenticated (HTTP 401): set HF_TOKEN to a token "
                               "with write access, or run `hf auth login`")
    if status == 403:
        return CheckpointError(f"{where} refused to let this token write to {repo_id} (HTTP 403): use a token with "
                               f"write access to {org} (HF_TOKEN or `hf auth login`), or push to a repo of your own")
    if isinstance(e, OfflineModeIsEnabled):
        return CheckpointError("HF_HUB_OFFLINE is set, so nothing can be pushed: unset it")
    if any(isinstance(c, (ConnectionRefusedError, socket.gaierror)) or _kinds(c) & {"ConnectError", "ConnectTimeout"}
           for c in causes):
        return CheckpointError(f"cannot reach {where} ({_one_line(causes[-1])}): check the network, and HF_ENDPOINT "
                               "if you set it (unset, it is https://huggingface.co)")
    if any(isinstance(c, (ConnectionError, TimeoutError)) or "TransportError" in _kinds(c) for c in causes):
        return CheckpointError(f"the upload to {where} was interrupted ({_one_line(e)}: {_one_line(causes[-1])}); "
                               f"nothing was committed to {repo_id}: run the same push again (files the Hub already "
                               "holds are not sent again)")
    if status is not None:
        return CheckpointError(f"{where} answered HTTP {status} for {repo_id}: {_one_line(e)}: run the push again; if "
                               "it fails the same way, see https://status.huggingface.co")
    return CheckpointError(f"pushing to {repo_id} at {where} failed: {type(e).__name__}: {_one_line(e)}: run the push "
                           "again; set HF_DEBUG=1 to see each request")


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def push_folder(folder: str | os.PathLike, repo_id: str, private: bool = False, revision: str | None = None,
                commit_message: str | None = None, progress: Callable[[str], None] | None = None) -> str:
    """Upload the model files of an exported `folder` to `repo_id` (created if needed); returns the commit URL.

    Refuses a folder whose weights are missing or empty. `private` applies when the repo is created;
    `revision` is a branch, created from main if needed; `progress` gets a line before the upload starts.
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    check_repo_id(repo_id)
    if not folder.is_dir():
        raise CheckpointError(f"not pushing {folder}: {'not a folder' if folder.exists() else 'it does not exist'}. "
                              "Push the folder that `hf-zero3 export CHECKPOINT FOLDER` wrote")
    if problems := verify_weights(folder):
        raise CheckpointError(f"not pushing {folder}: {'; '.join(problems)}. Push a folder written by "
                              "`hf-zero3 export`")
    adapter = holds_adapter(folder)
    if not adapter and not (folder / "config.json").is_file():
        raise CheckpointError(f"not pushing {folder}: no config.json, so from_pretrained could not load it")
    if progress:
        files = [p for p in folder.iterdir() if p.is_file() and any(fnmatch(p.name, pattern) for pattern in PUSHED)]
        progress(f"push: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e9:.2f} GB to {repo_id} "
                 "(huggingface_hub shows each upload)")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        # the weights of an earlier push go in the same commit: a single model.safetensors left beside a new
        # sharded index would be what from_pretrained loads
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision, allow_patterns=PUSHED,
                                 delete_patterns=None if adapter else STALE_WEIGHTS,
                                 commit_message=commit_message or f"Upload {folder.name} with hf_zero3")
    except Exception as e:
        raise _push_error(e, repo_id) from e
    return info.commit_url
