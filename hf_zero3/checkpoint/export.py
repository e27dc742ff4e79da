"""ZeRO-3 checkpoint -> plain Hugging Face folder (export), and -> DeepSpeed universal checkpoint (reshard).

Why export: the optimizer shards are the only complete copy of the fp32 weights (the 16-bit file exists only
with gathering on, in the training dtype). DeepSpeed's `zero_to_fp32` rebuilds them, but its default path
loads the whole model into RAM; here we use its lazy mode (memory-mapped shards, one output shard
materialised at a time), so peak RAM is about one `--shard-size` plus the largest tensor, whatever the model.
Why reshard: a ZeRO checkpoint is partitioned for the world size that wrote it; DeepSpeed's universal format
holds whole tensors per parameter, which any number of ranks can load (`"checkpoint": {"load_universal": true}`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from hf_zero3.checkpoint import adapter
from hf_zero3.checkpoint.adapter import base_problem
from hf_zero3.checkpoint.card import model_card
from hf_zero3.checkpoint.contents import (
    deepspeed_tag_dir,
    holds_adapter,
    universal_tag,
    verify_adapter,
    verify_checkpoint,
    verify_weights,
)
from hf_zero3.checkpoint.lifecycle import CheckpointError, is_complete, newest_complete, read_finished
from hf_zero3.checkpoint.names import meta_model, to_saved_layout
from hf_zero3.checkpoint.nvme_states import OFFLOADED, has_nvme_states, swapped_fp32_groups
from hf_zero3.units import parse_size

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""--dtype choices -> torch dtype names (as config.json spells them)."""

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
          "merges.txt", "chat_template.jinja", "chat_template.json")
"""The non-weight files of a plain HF model folder, copied from the checkpoint when present."""


def finished_zero_shards(folder: Path) -> bool:
    """A finished run's output_dir whose final save wrote ZeRO shards (16-bit gathering off): the Trainer's
    `save_model` put them there after the last step, which may be past the newest checkpoint-N. The finished record
    names them; a `latest` left by an earlier run in the same folder does not count."""
    shards = (read_finished(folder) or {}).get("zero_shards")
    try:
        return bool(shards) and shards == (folder / "latest").read_text().strip()
    except OSError:
        return False


def _require_complete(checkpoint: Path) -> None:
    if finished_zero_shards(checkpoint):
        return
    if holds_adapter(checkpoint) and read_finished(checkpoint) is not None:  # a LoRA run's final adapter
        if problems := verify_adapter(checkpoint):
            raise CheckpointError(f"{checkpoint}: its final adapter is not sound: {'; '.join(problems[:5])}. "
                                  f"{_instead(checkpoint)}")
        return
    if not is_complete(checkpoint) and (problems := verify_checkpoint(checkpoint)):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint: {'; '.join(problems[:5])}. "
                              f"{_instead(checkpoint)}")


def _instead(path: Path) -> str:
    """What to pass instead of `path`: the newest complete checkpoint in it or the one holding it, if any."""
    for folder in (path, path.parent):
        if folder.is_dir() and (newest := newest_complete(folder)):
            return f"Pass a complete checkpoint-N folder, e.g. {newest} (the newest in {folder})"
    if path.parent.is_dir() and is_complete(path.parent):
        return f"Pass the checkpoint folder that holds it: {path.parent}"
    return "Pass a complete checkpoint-N folder (one that hf_zero3 marked complete when it saved it)"


def shard_bytes(size: str | int) -> int:
    """Bytes per safetensors shard: an int, or text in the planner's size grammar (5GB, 500MB, 1GiB, 512G)."""
    try:
        value = parse_size(size) if isinstance(size, str) else int(size)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"shard size: {e}") from None
    if value < 1:
        raise CheckpointError(f"shard size {size!r} is not positive: give one of at least 1 byte, e.g. 5GB, "
                              "500MB or 1GiB")
    return value


def claim_staging(tmp: Path) -> None:
    """Make `tmp` ours to write: a leftover of ours (killed export or reshard) is removed, anything else is refused.

    Ours is known by the owner file beside it (`<tmp>.owner`), written as the folder is made and removed after the
    final rename; a folder of that name without it is someone's data and is never deleted."""
    owner = tmp.with_name(tmp.name + ".owner")
    if tmp.exists() or tmp.is_symlink():
        if not owner.is_file():
            raise CheckpointError(f"{tmp} exists and was not left by hf-zero3 (no {owner.name} beside it): move it "
                                  "away or choose another output folder; nothing was deleted")
        tmp.unlink() if tmp.is_symlink() else shutil.rmtree(tmp)  # our own leftover from a run that was killed


def mark_staging(tmp: Path) -> None:
    """Write the owner file that makes a leftover `tmp` ours to remove (see `claim_staging`)."""
    owner = tmp.with_name(tmp.name + ".owner")
    try:
        owner.write_text("hf-zero3 staging folder: safe to delete together with the folder of the same name\n")
    except OSError as e:
        raise CheckpointError(f"cannot write {owner}: {e.strerror}: choose an output folder you can write to") from e


def release_staging(tmp: Path) -> None:
    """The staging folder is gone (renamed into place or removed): its owner file goes too."""
    tmp.with_name(tmp.name + ".owner").unlink(missing_ok=True)


def _staging(out: Path) -> tuple[Path, Path]:
    """out must be new or empty (nothing is overwritten); we write next to it and rename when done.

    Returns (the staging folder, the outermost folder this created): what to remove if the export fails."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty: choose a new output folder")
    tmp = out.with_name(f".{out.name}.partial")
    claim_staging(tmp)
    created = next((p for p in reversed(tmp.parents) if not p.exists()), tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {tmp}: {e.strerror}: choose an output folder you can write to") from e
    try:
        mark_staging(tmp)
    except CheckpointError:
        shutil.rmtree(created, ignore_errors=True)
        raise
    return tmp, created


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "bf16",
                      max_shard_size: str | int = "5GB", license: str | None = None,
                      progress: Callable[[str], None] | None = None, merge: bool = False,
                      base: str | None = None) -> Path:
    """Write `out`: sharded safetensors of the fp32 master weights cast to `dtype`, config, tokenizer, card.

    Tied parameters (DeepSpeed's `shared_params`, e.g. lm_head tied to the embeddings) are written once, and
    tensors transformers converts on load (a mixture of experts' fused experts) in the layout it saves, as
    `save_pretrained` does (`checkpoint.names`); `from_pretrained` ties and fuses them again. Arguments are checked before anything is
    written, and a failed export leaves nothing behind (the staging folder and any folder it created go).
    `license` goes into the card's metadata (default: the run's `hub_license`, else "other"); `progress` gets a
    line per shard written (an 8B export takes minutes). A LoRA run's checkpoint or final adapter exports as the
    adapter folder, or with `merge` as the base model (`base`: default the one it was trained on) with the adapter
    merged in (hf_zero3.checkpoint.adapter).
    """
    checkpoint, out = Path(checkpoint), Path(os.path.realpath(out))  # ".", a link: the folder it names
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    max_shard_size = shard_bytes(max_shard_size)
    adapter = holds_adapter(checkpoint)
    if (merge or base) and not adapter:
        raise CheckpointError(f"{checkpoint} holds a full model, not a LoRA adapter: --merge and --base are for a "
                              "LoRA run's checkpoint or output_dir; drop them to export it")
    if merge and (problem := base_problem(checkpoint, base)):
        raise CheckpointError(problem)
    _require_complete(checkpoint)
    if out == checkpoint.resolve() or checkpoint.resolve() in out.parents:
        raise CheckpointError(f"{out} is inside {checkpoint}, which keep-last-N deletes with everything in it: "
                              "export to a folder outside the checkpoint")
    tmp, created = _staging(out)
    try:
        if adapter:
            _write_adapter_export(checkpoint, tmp, dtype, max_shard_size, license, progress, merge, base)
        else:
            _write_export(checkpoint, tmp, dtype, max_shard_size, license, progress)
            if problems := verify_weights(tmp, shapes_from=checkpoint):
                raise CheckpointError(f"export of {checkpoint} is wrong: {'; '.join(problems)}")
        tmp.rename(out)
        release_staging(tmp)
    except BaseException as e:
        shutil.rmtree(created, ignore_errors=True)  # a failed export leaves nothing behind
        release_staging(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"export of {checkpoint} failed, nothing written: {e}: check that the checkpoint "
                                  f"is readable and that {out.parent} is writable with free space") from e
        if isinstance(e, Exception) and not isinstance(e, CheckpointError):
            raise CheckpointError(f"export of {checkpoint} failed, nothing written: {type(e).__name__}: {e}: its "
                                  "DeepSpeed files are unreadable; export another complete checkpoint") from e
        raise
    return out


def _write_export(checkpoint: Path, tmp: Path, dtype: str, max_shard_size: int, license: str | None,
                  progress: Callable[[str], None] | None = None) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tag_dir, problems = deepspeed_tag_dir(checkpoint)
    if tag_dir is None:
        raise CheckpointError(f"{checkpoint}: {'; '.join(problems)}. {_instead(checkpoint)}")
    with swapped_fp32_groups(tag_dir):  # ZeRO-Infinity: the swapped fp32 weights are files beside the shards
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), lazy_mode=True)
    first_name: dict[int, str] = {}
    lazy = {name: t for name, t in lazy.items() if first_name.setdefault(id(t), name) == name}
    empty = to_torch_tensor(lazy, return_empty_tensor=True, dtype=DTYPES[dtype])
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    layout = meta_model(checkpoint)  # the saved layout: a mixture of experts' fused tensors go back per expert
    started, written, count = time.monotonic(), 0, len(split.filename_to_tensors)
    weight_map: dict[str, str] = {}
    for number, (filename, names) in enumerate(split.filename_to_tensors.items(), 1):
        shard = to_saved_layout(layout, to_torch_tensor({name: lazy[name] for name in names}, dtype=DTYPES[dtype]))
        shard = {name: t.contiguous() for name, t in shard.items()}
        save_file(shard, str(tmp / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
        written += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
        if progress and written:
            elapsed = time.monotonic() - started
            progress(f"export: shard {number}/{count} {filename}: {written / 1e9:.2f} of "
                     f"{split.metadata['total_size'] / 1e9:.2f} GB, {elapsed:.0f} s, "
                     f"ETA {elapsed / written * max(0, split.metadata['total_size'] - written):.0f} s")
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, tmp / name)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = DTYPES[dtype]
    config.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_ready(tmp)
    (tmp / "README.md").write_text(str(model_card(checkpoint, dtype=dtype, license=license)))


def _write_adapter_export(checkpoint: Path, tmp: Path, dtype: str, max_shard_size: int, license: str | None,
                          progress: Callable[[str], None] | None, merge: bool, base: str | None) -> None:
    def card(kind: str) -> str:
        return str(model_card(checkpoint, dtype=dtype, license=license, kind=kind, base_model=base))

    if merge:
        adapter.write_merged(checkpoint, tmp, DTYPES[dtype], base, max_shard_size, card, progress)
        generation_ready(tmp)
    else:
        adapter.write_adapter(checkpoint, tmp, DTYPES[dtype], card, progress)


def generation_ready(folder: Path) -> None:
    """Turn the KV cache back on in `folder`'s config.json and generation_config.json.

    Why: training sets `use_cache: false` (the cache only costs memory there) and save_pretrained writes it into
    both files, so `generate` and `pipeline` would recompute every past token at each new one."""
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            config = json.loads(path.read_text())
            if config.get("use_cache") is False:
                config["use_cache"] = True
                path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def reshard_checkpoint(checkpoint: str | os.PathLike, workers: int = 2) -> Path:
    """Add a DeepSpeed universal copy next to the ZeRO shards (`global_stepN_universal` + `latest_universal`).

    The original shards stay: the checkpoint still resumes on its own world size, and on any other one with
    `"checkpoint": {"load_universal": true}` in the ds_config.
    """
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    checkpoint = Path(checkpoint)
    _require_complete(checkpoint)
    tag_dir, _ = deepspeed_tag_dir(checkpoint)
    if has_nvme_states(tag_dir):
        raise CheckpointError(f"{checkpoint} keeps its optimizer states on NVMe ({tag_dir / OFFLOADED}), which "
                              "DeepSpeed's universal conversion does not read: resume it on the world size that "
                              "saved it, or export its weights (hf-zero3 export) and fine-tune from those")
    out = checkpoint / f"{tag_dir.name}_universal"
    if out.is_dir():  # it gets its name only once the conversion is whole
        if universal_tag(checkpoint) != out:  # killed after the rename: latest_universal still names the .partial
            _write_latest_universal(checkpoint, out)
        return out
    tmp = checkpoint / f".{out.name}.partial"
    claim_staging(tmp)
    mark_staging(tmp)
    try:
        ds_to_universal(Namespace(input_folder=str(tag_dir), output_folder=str(tmp), num_extract_workers=workers,
                                  num_merge_workers=workers, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True))
        tmp.rename(out)
        release_staging(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion leaves nothing behind
        release_staging(tmp)
        if isinstance(e, Exception):
            raise CheckpointError(f"reshard of {checkpoint} failed, nothing written: {type(e).__name__}: {e}: check "
                                  f"that its files are readable and that it has free space") from e
        raise
    _write_latest_universal(checkpoint, out)
    return out


def _write_latest_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's own `ds_to_universal` pointed it at the staging folder: point it at the finished copy."""
    (checkpoint / ".latest_universal.tmp").write_text(out.name)
    os.replace(checkpoint / ".latest_universal.tmp", checkpoint / "latest_universal")
