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
from pathlib import Path

from hf_zero3.checkpoint import (
    CheckpointError,
    deepspeed_tag_dir,
    is_complete,
    verify_checkpoint,
    verify_weights,
)

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""--dtype choices -> torch dtype names (as config.json spells them)."""

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
          "merges.txt", "chat_template.jinja", "chat_template.json")
"""The non-weight files of a plain HF model folder, copied from the checkpoint when present."""


def _require_complete(checkpoint: Path) -> None:
    if not is_complete(checkpoint) and (problems := verify_checkpoint(checkpoint)):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint: {'; '.join(problems[:5])}")


def _staging(out: Path) -> Path:
    """out must be new or empty (nothing is overwritten); we write next to it and rename when done."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty: choose a new output folder")
    tmp = out.with_name(f".{out.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own leftover from an interrupted export
    tmp.mkdir(parents=True)
    return tmp


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "bf16",
                      max_shard_size: str | int = "5GB") -> Path:
    """Write `out`: sharded safetensors of the fp32 master weights cast to `dtype`, config, tokenizer, card.

    Tied parameters (DeepSpeed's `shared_params`, e.g. lm_head tied to the embeddings) are written once, as
    `save_pretrained` does; `from_pretrained` ties them again.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from hf_zero3.hub import model_card

    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    _require_complete(checkpoint)
    tmp = _staging(out)
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), lazy_mode=True)
    first_name: dict[int, str] = {}
    lazy = {name: t for name, t in lazy.items() if first_name.setdefault(id(t), name) == name}
    empty = to_torch_tensor(lazy, return_empty_tensor=True, dtype=DTYPES[dtype])
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = to_torch_tensor({name: lazy[name] for name in names}, dtype=DTYPES[dtype])
        save_file(shard, str(tmp / filename), metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for name in COPIED:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, tmp / name)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = DTYPES[dtype]
    config.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (tmp / "README.md").write_text(model_card(checkpoint, dtype=dtype))
    if problems := verify_weights(tmp, shapes_from=checkpoint):
        raise CheckpointError(f"export of {checkpoint} is wrong (kept for inspection in {tmp}): "
                              f"{'; '.join(problems)}")
    tmp.rename(out)
    return out


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
    out = checkpoint / f"{tag_dir.name}_universal"
    if (checkpoint / "latest_universal").is_file() and out.is_dir():
        return out
    tmp = checkpoint / f".{out.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    ds_to_universal(Namespace(input_folder=str(tag_dir), output_folder=str(tmp), num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=True))
    tmp.rename(out)
    (checkpoint / ".latest_universal.tmp").write_text(out.name)
    os.replace(checkpoint / ".latest_universal.tmp", checkpoint / "latest_universal")
    return out
