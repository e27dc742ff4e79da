"""A LoRA run's save -> a peft adapter folder (adapter_config.json, adapter_model.safetensors), or the base model
with the adapter merged into its weights: what `hf-zero3 export` writes for a LoRA checkpoint or final adapter.

Why not the checkpoint folder as it is: its adapter is in the training dtype, beside optimizer and RNG state. From
a checkpoint the adapter is rebuilt from the fp32 master weights in the ZeRO shards (only the adapter trains, so
they hold nothing else), checked against the 16-bit adapter the save verified, and cast to the export's dtype.
The merge is peft's own (`merge_and_unload`) on the base loaded with transformers: it goes through the model's own
weight names, whatever the architecture; it needs the host RAM of the base in the export's dtype.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from hf_zero3.checkpoint.contents import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    _weight_files,
    adapter_key,
    adapter_tensors,
    verify_adapter,
)
from hf_zero3.checkpoint.lifecycle import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
"""Copied into an adapter export beside the adapter: the tokenizer the run trained with."""
ROUNDING = {"torch.bfloat16": 2**-7, "torch.float16": 2**-10, "torch.float32": 1e-6}
"""How far a 16-bit weight may be from its fp32 master (relative): one unit in the last place."""


def base_of(folder: str | Path) -> str | None:
    """The base model a saved adapter was trained on (`base_model_name_or_path` in its config)."""
    try:
        return json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError, AttributeError):
        return None


def base_problem(checkpoint: Path, base: str | None) -> str | None:
    """What stops a merge before anything loads: no base model named, or a base folder that is not there (which
    transformers would read as a malformed hub id: "Repo id must be in the form ...")."""
    named = base or base_of(checkpoint)
    if not named:
        return (f"{checkpoint}'s {ADAPTER_CONFIG} names no base model: pass --base MODEL (the folder or hub id the "
                "adapter was trained on)")
    path = Path(named).expanduser()
    if not path.is_dir() and (path.is_absolute() or named.startswith((".", "~")) or named.count("/") > 1
                              or path.exists()):
        where = "--base" if base else f"base_model_name_or_path in {checkpoint / ADAPTER_CONFIG}"
        return (f"the base model {named} ({where}) is {'not a folder' if path.exists() else 'not there'}: pass "
                "--base MODEL, the folder or hub id of the weights the adapter was trained on")
    return None


def trained_weights(checkpoint: Path) -> dict:
    """{saved key: tensor} of the adapter at its best precision: the fp32 masters of a checkpoint's ZeRO shards, each
    checked against the 16-bit tensor the save wrote (its rounding); the saved adapter where there are no shards (a
    finished run's output_dir)."""
    import torch

    saved = adapter_tensors(checkpoint)
    if not (checkpoint / "latest").is_file():
        return saved
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    # lazy: only the adapter is read, should the shards hold a frozen base too (a save that kept it)
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), lazy_mode=True)
    masters = to_torch_tensor({adapter_key(name): tensor for name, tensor in lazy.items()
                               if adapter_key(name) in saved or ".lora_" in name})
    masters = {key: tensor.detach() for key, tensor in masters.items()}
    if set(masters) != set(saved):
        odd = sorted(set(masters) ^ set(saved))
        raise CheckpointError(f"{checkpoint}: the ZeRO shards and {ADAPTER_WEIGHTS} hold different adapter tensors "
                              f"({len(odd)}, e.g. {odd[0]}): export another complete checkpoint")
    for key, master in masters.items():
        tolerance = ROUNDING.get(str(saved[key].dtype), 2**-7)
        if master.shape != saved[key].shape or not torch.allclose(master.to(saved[key].dtype).double(),
                                                                  saved[key].double(), rtol=tolerance, atol=0):
            raise CheckpointError(f"{checkpoint}: {key} in the ZeRO shards is not the {ADAPTER_WEIGHTS} it saved: "
                                  "export another complete checkpoint")
    return masters


def write_adapter(checkpoint: Path, tmp: Path, dtype: str, card: Callable[[str], str],
                  progress: Callable[[str], None] | None = None) -> None:
    """Write the adapter folder into `tmp`: weights in `dtype` (a torch dtype name), its config, the tokenizer, the
    card (`card(kind)` gives its text)."""
    import torch
    from safetensors.torch import save_file

    weights = {k: t.to(getattr(torch, dtype)).contiguous() for k, t in trained_weights(checkpoint).items()}
    save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    shutil.copy2(checkpoint / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
    for name in TOKENIZER_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, tmp / name)
    (tmp / "README.md").write_text(card("adapter"))
    if problems := verify_adapter(tmp, expected={k: (tuple(t.shape), float(t.double().norm()))
                                                 for k, t in weights.items()}):
        raise CheckpointError(f"the adapter export of {checkpoint} is wrong: {'; '.join(problems[:5])}")
    if progress:
        progress(f"export: adapter, {len(weights)} tensors, {sum(t.numel() for t in weights.values()):,} parameters")


def write_merged(checkpoint: Path, tmp: Path, dtype: str, base: str | None, max_shard_size: int,
                 card: Callable[[str], str], progress: Callable[[str], None] | None = None) -> None:
    """Write into `tmp` the base model with the adapter merged into its weights (`dtype`, shards of at most
    `max_shard_size` bytes), its tokenizer and card. `base`: the base model's folder or hub id (default: the one the
    adapter was trained on)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if problem := base_problem(checkpoint, base):
        raise CheckpointError(problem)
    base = base or base_of(checkpoint)
    scratch = tmp / ".adapter"
    scratch.mkdir()
    write_adapter(checkpoint, scratch, dtype, card)
    if progress:
        progress(f"export: merging into {base} (loaded in {dtype} on the host)")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the base model {base} to merge into: {e}. Pass --base MODEL (a folder "
                              "or hub id of the weights the adapter was trained on)") from e
    model = PeftModel.from_pretrained(model, scratch).merge_and_unload()
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    shutil.rmtree(scratch)
    for name in TOKENIZER_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, tmp / name)
    (tmp / "README.md").write_text(card("merged"))
    if problems := same_tensors(tmp, base):
        raise CheckpointError(f"the merged export of {checkpoint} is wrong: {'; '.join(problems[:5])}")


def same_tensors(merged: Path, base: str) -> list[str]:
    """Problems unless `merged` holds the tensors of the base model's own weight files, each with its shape (a
    merge changes values, never names or shapes). A hub base is read from the cache its load filled."""
    from safetensors import safe_open

    def shapes(folder: Path) -> dict[str, tuple[int, ...]]:
        found = {}
        for path in _weight_files(folder):
            with safe_open(path, framework="pt") as f:
                found.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        return found

    folder = Path(base)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(base, local_files_only=True, allow_patterns=["*.safetensors*"]))
        except Exception:  # noqa: BLE001 -- a base without safetensors in the cache: its files cannot be compared
            return []
    expected, written = shapes(folder), shapes(merged)
    if not written:
        return ["no model weights written"]
    if not expected:
        return []
    problems = [f"{k}: shape {written[k]} written, {expected[k]} in the base" for k in expected
                if k in written and written[k] != expected[k]]
    if missing := sorted(set(expected) - set(written)):
        problems.append(f"{len(missing)} tensor(s) of the base not written, e.g. {missing[0]}")
    if extra := sorted(set(written) - set(expected)):
        problems.append(f"{len(extra)} tensor(s) that the base does not have, e.g. {extra[0]} (the adapter was "
                        "not merged)")
    return problems
