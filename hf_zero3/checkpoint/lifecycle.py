"""What a complete ZeRO-3 checkpoint is, the records that say so, keep-last-N over complete ones, and resume.

Why: a ZeRO-3 checkpoint is many files written by many ranks. A crash, a kill or a full disk mid-save leaves
a `checkpoint-N` folder that looks saved but cannot be resumed (or holds no usable weights); a bit flip or a
lost file later leaves one that looks complete but is not. A checkpoint counts only when every part was
verified after the save and the marker, written last and atomically, lists every file with its size and
checksum: resume verifies those before DeepSpeed opens a file. Nothing is ever deleted unless it is provably
our own unfinished write (or a rotation of ours that a kill interrupted); anything else is left in place and
reported by name with the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hf_zero3.checkpoint.names import saved_shapes

DEFAULT_SAVE_STEPS = 500
"""Save every 500 optimizer steps: the default for recipes that run long enough (the tiny one saves every 50)."""
DEFAULT_SAVE_TOTAL_LIMIT = 3
"""Keep the newest 3 complete checkpoints."""

MARKER = "hf_zero3_complete.json"
"""Written into a checkpoint folder last, after every part was verified; lists every file with size and checksum."""
SAVING = "hf_zero3_saving"
"""Written into a checkpoint folder before the save starts, removed with the marker: "ours, unfinished". Holds the
run id of the output_dir and the step, so only a save that a run on this output_dir started is ever deleted."""
FAILED = "hf_zero3_failed.json"
"""Written into a marked checkpoint whose files failed their checksums when a run looked for one to resume: from
then on it is damaged, never complete. Otherwise keep-last-N would still count it (by size it looks whole) and, its
step being higher, keep it and delete the good checkpoints the resumed run writes. The folder stays for the user."""
RUN_ID = "hf_zero3_run.json"
"""In output_dir: the id of the run that owns it (created when a run starts there)."""
FINISHED = "hf_zero3_finished.json"
"""In output_dir: written after the final model and metrics, removed when training starts again."""
DELETING = ".deleting-"
"""Rotation renames `checkpoint-N` to `.deleting-checkpoint-N` before deleting it: a kill mid-delete leaves a name
that nothing counts, and the next start finishes the deletion."""
HASH = "xxh3_64"
"""Checksum of every file in the marker: xxHash3, ~3.6 GB/s per core from the page cache (crc32: ~1.9)."""

_STEP = re.compile(r"^checkpoint-(\d+)$")
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_|rng_state_(\d+)\.pth$")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or cannot be written; the message names the fix."""


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N for a `checkpoint-N` folder name, else None."""
    match = _STEP.match(Path(path).name)
    return int(match.group(1)) if match else None


def resume_step(checkpoint: str | os.PathLike) -> int | None:
    """The step a checkpoint folder holds: N of its name, or of the folder a link (`best`) points to, else its
    trainer state's global_step (a copy renamed by hand); None when none says."""
    path = Path(checkpoint)
    step = checkpoint_step(path)
    if step is None:
        step = checkpoint_step(path.resolve())
    if step is None:
        try:
            step = int(json.loads((path / "trainer_state.json").read_text())["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return step


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where the Trainer saves step `step`: `output_dir/checkpoint-N`."""
    return Path(output_dir) / f"checkpoint-{step}"


def file_hash(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """xxh3_64 of a file's bytes, read in 8 MiB chunks (memory stays flat for a 100 GB shard)."""
    import xxhash

    digest, buffer = xxhash.xxh3_64(), bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def file_owner(name: str, world_size: int, writer: int = 0) -> int:
    """The rank that wrote (and so hashes and verifies) a checkpoint file: its own shards and RNG state; the folder's
    `writer` the rest (rank 0; on node-local disks each node's first rank, which writes that node's copy). A file of
    a rank beyond `world_size` (resuming on fewer ranks) goes to rank % world_size."""
    match = _RANK_FILE.search(name)
    if not match:
        return writer
    return int(match.group(1) or match.group(2)) % max(world_size, 1)


def hash_files(checkpoint: str | os.PathLike, rank: int = 0, world_size: int = 1, writer: int = 0) -> dict[str, str]:
    """{relative path: checksum} of the files of `checkpoint` that `rank` owns (all files for one rank)."""
    root = Path(checkpoint)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (MARKER, SAVING))
    return {str(p.relative_to(root)): file_hash(p) for p in files
            if file_owner(str(p.relative_to(root)), world_size, writer) == rank}


def weights_gathered(ds_config: dict | None) -> bool:
    """Whether a save writes full 16-bit weights: always, unless ZeRO-3 runs with 16-bit gathering off."""
    zero = (ds_config or {}).get("zero_optimization", {})
    return zero.get("stage") != 3 or bool(zero.get("stage3_gather_16bit_weights_on_model_save",
                                                   zero.get("stage3_gather_fp16_weights_on_model_save")))


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Every `checkpoint-N` folder in output_dir, oldest step first, complete or not."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def _zip_problem(path: Path) -> str | None:
    """torch.save files are zip archives: a truncated or empty one has no readable central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                return f"{path.name} holds no pickled object"
    except (OSError, zipfile.BadZipFile) as e:
        return f"{path.name} is unreadable ({e})"
    return None


def deepspeed_tag_dir(checkpoint: Path) -> tuple[Path | None, list[str]]:
    """The `global_stepN` folder that `latest` names, or the problems finding it."""
    try:
        tag = (checkpoint / "latest").read_text().strip()
    except OSError:
        return None, ["no `latest` tag file (DeepSpeed did not finish its save)"]
    if not tag or not (checkpoint / tag).is_dir():
        return None, [f"`latest` names {tag!r}, which is not a folder here"]
    return checkpoint / tag, []


def universal_tag(checkpoint: str | os.PathLike) -> Path | None:
    """The universal copy that `latest_universal` names (`hf-zero3 reshard`), if that folder is there."""
    try:
        tag = (Path(checkpoint) / "latest_universal").read_text().strip()
    except OSError:
        return None
    folder = Path(checkpoint) / tag
    return folder if tag and not tag.startswith(".") and folder.is_dir() else None


def verify_rank_files(checkpoint: str | os.PathLike, rank: int, world_size: int,
                      deepspeed: bool = True) -> list[str]:
    """Problems with one rank's own files: its DeepSpeed model/optimizer shards and its RNG state.

    Without DeepSpeed the optimizer is one `optimizer.pt`, written by rank 0.
    """
    checkpoint = Path(checkpoint)
    problems = []
    if deepspeed:
        tag_dir, tag_problems = deepspeed_tag_dir(checkpoint)
        if tag_dir is None:
            return [f"rank {rank}: {p}" for p in tag_problems]
        for kind in ("model_states", "optim_states"):
            if kind == "model_states":
                shards, required = model_states_files(tag_dir, rank)
            else:
                shards, required = optim_states_files(tag_dir, rank), True
            if not shards and required:
                problems.append(f"rank {rank}: no {kind} shard in {tag_dir.name}")
            problems += [f"rank {rank}: {p}" for shard in shards if (p := _zip_problem(shard))]
    elif rank == 0 and (p := _zip_problem(checkpoint / "optimizer.pt")):
        problems.append(p)
    rng = checkpoint / (f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth")
    if p := _zip_problem(rng):
        problems.append(f"rank {rank}: RNG state {p}")
    return problems


def optim_states_files(tag_dir: Path, rank: int) -> list[Path]:
    """This rank's ZeRO optimizer shards (`*zero_pp_rank_R_mp_rank_00_optim_states.pt`, one per rank)."""
    return sorted(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_*_optim_states.pt"))


def model_states_files(tag_dir: Path, rank: int) -> tuple[list[Path], bool]:
    """(this rank's model-states files, whether the rank must have one).

    ZeRO-3 writes one `*zero_pp_rank_R_mp_rank_00_model_states.pt` per rank; ZeRO-0/1/2 write a single
    `mp_rank_00_model_states.pt` from rank 0 and none from the other ranks.
    """
    zero3 = sorted(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_*_model_states.pt"))
    if zero3:
        return zero3, True
    dense = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if dense:
        return (dense if rank == 0 else []), rank == 0
    return [], True


def _weight_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint / name for name in names]
    single = checkpoint / "model.safetensors"
    return [single] if single.is_file() else []


def param_shapes(checkpoint: str | os.PathLike) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> shape of every trained parameter, tied name -> the name it shares) from rank 0's model states."""
    import torch

    tag_dir, problems = deepspeed_tag_dir(Path(checkpoint))
    if tag_dir is None:
        raise CheckpointError(f"{checkpoint}: {problems[0]}")
    model_states, _ = model_states_files(tag_dir, 0)
    if not model_states:
        raise CheckpointError(f"{checkpoint}: no model_states file of rank 0 in {tag_dir.name}")
    # mmap: below ZeRO-3 this file holds the whole 16-bit model; only its metadata is read here
    state = torch.load(model_states[0], map_location="cpu", weights_only=True, mmap=True)
    shapes = {name: tuple(shape) for group in state["param_shapes"] for name, shape in group.items()}
    shapes.update({name: tuple(shape) for name, shape in (state.get("frozen_param_shapes") or {}).items()})
    return shapes, dict(state.get("shared_params") or {})


ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""What peft's save_pretrained writes for a LoRA run (checkpoints, the final model, `hf-zero3 export`)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"
"""The name peft gives the one adapter a run trains; it is in the parameter names, not in the saved keys."""
ADAPTER_RTOL = 1e-3
"""How far a saved adapter tensor's norm may be from the trained parameter's: summation order only."""


def holds_adapter(folder: str | os.PathLike) -> bool:
    """A peft adapter folder (a LoRA run's checkpoint or final model, an adapter export): its config and no model
    weights of its own."""
    return (Path(folder) / ADAPTER_CONFIG).is_file() and not _weight_files(Path(folder))


def adapter_key(name: str, adapter: str = ADAPTER_NAME) -> str:
    """A trained parameter's name as peft saves it, without the adapter's name (`q_proj.lora_A.default.weight` ->
    `q_proj.lora_A.weight`): peft's own rule (`_remove_adapter_name_from_key`) where this peft has it."""
    from peft.tuners.lora import LoraModel

    rule = getattr(LoraModel, "_remove_adapter_name_from_key", None)
    return rule(name, adapter) if rule is not None else name.replace(f".{adapter}", "")


def adapter_tensors(folder: str | os.PathLike) -> dict:
    """{saved key: tensor} of an adapter folder's weights (an adapter is small: read whole)."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / ADAPTER_WEIGHTS))


def verify_adapter(folder: str | os.PathLike, expected: dict[str, tuple[tuple[int, ...], float]] | None = None,
                   shapes_from: str | os.PathLike | None = None) -> list[str]:
    """Problems with a saved LoRA adapter: its config, every trained tensor there with its real shape (never the
    `torch.Size([0])` placeholder of a ZeRO-3 partition), finite, and with a non-zero norm.

    `expected` ({saved key: (shape, norm)} of the trained parameters, gathered when the save was made): the saved
    tensors must be exactly these, each norm within `ADAPTER_RTOL` of the trained one; a zero norm passes only
    where the trained parameter is zero too (LoRA's B starts at zero and stays there while the learning rate is
    0, the first warm-up step). Without it, the shapes come from DeepSpeed's model states in `shapes_from`
    (default: `folder`, when it holds them), and every lora_A must be non-zero (peft initialises A at random,
    B at zero).
    """
    import torch

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        if not isinstance(config, dict) or "peft_type" not in config:
            return [f"{ADAPTER_CONFIG} is not a peft adapter config (no peft_type)"]
    except (OSError, ValueError) as e:
        return [f"{ADAPTER_CONFIG} is missing or unreadable ({e})"]
    try:
        saved = adapter_tensors(folder)
    except Exception as e:  # safetensors raises its own error types for a truncated file
        return [f"{ADAPTER_WEIGHTS} is missing or unreadable ({e})"]
    if not saved:
        return [f"{ADAPTER_WEIGHTS} holds no tensors (the adapter was not gathered when it was saved)"]
    if expected is None:
        source = Path(shapes_from or folder)
        shapes = param_shapes(source)[0] if (source / "latest").is_file() else {}
        expected_shapes = {adapter_key(name): shape for name, shape in shapes.items()}
    else:
        expected_shapes = {key: tuple(shape) for key, (shape, _) in expected.items()}
    problems = [f"{key}: saved with shape {tuple(t.shape)} (no values)" for key, t in saved.items() if t.numel() == 0]
    problems += [f"{key}: not finite" for key, t in saved.items() if t.numel() and not torch.isfinite(t).all()]
    if missing := [k for k in expected_shapes if k not in saved]:
        problems.append(f"{len(missing)} trained adapter tensor(s) missing from {ADAPTER_WEIGHTS}, e.g. {missing[0]}")
    if expected_shapes and (extra := [k for k in saved if k not in expected_shapes]):
        problems.append(f"{len(extra)} tensor(s) in {ADAPTER_WEIGHTS} that were not trained, e.g. {extra[0]}")
    problems += [f"{k}: shape {tuple(saved[k].shape)} saved, {expected_shapes[k]} trained"
                 for k in expected_shapes if k in saved and tuple(saved[k].shape) != expected_shapes[k]][:3]
    norms = {k: float(t.double().norm()) for k, t in saved.items() if t.numel()}
    if expected is not None:
        for key, (_, trained) in expected.items():
            got = norms.get(key)
            if got is not None and abs(got - trained) > ADAPTER_RTOL * max(abs(trained), 1e-12):
                problems.append(f"{key}: norm {got:.6g} saved, {trained:.6g} trained" if got else
                                f"{key}: saved as zeros, but the trained tensor's norm is {trained:.6g}")
    else:
        problems += [f"{k}: all zeros (peft initialises lora_A at random and training never zeroes it)"
                     for k, n in norms.items() if n == 0 and ".lora_A." in k][:3]
    return problems


SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
              "num_local_experts", "tie_word_embeddings")
"""The config.json keys that fix a model's parameter shapes (and with them a checkpoint's)."""


def shape_difference(checkpoint: str | os.PathLike, config) -> list[str]:
    """How the model a checkpoint was saved from (its config.json) differs in shape from `config` (a transformers
    config): `key saved (checkpoint) vs new (this model)` per key of SHAPE_KEYS; empty when they agree or the
    checkpoint has no config.json."""
    saved = _read_json(Path(checkpoint) / "config.json")
    if saved is None:
        return []
    return [f"{key} {saved[key]} (checkpoint) vs {getattr(config, key, None)} (this model)"
            for key in SHAPE_KEYS if key in saved and saved[key] != getattr(config, key, None)]


def verify_weights(checkpoint: str | os.PathLike, shapes_from: str | os.PathLike | None = None) -> list[str]:
    """Problems with the gathered 16-bit weights: every trained parameter present, right shape, not empty.

    "Trained parameters" are the ones DeepSpeed's model states list (tied copies excepted), in the layout
    `save_pretrained` writes (`checkpoint.names`: a mixture of experts' fused tensors are saved per expert). Reads
    only headers, so it costs milliseconds even for a 70B model. `shapes_from`: the DeepSpeed checkpoint to
    compare with (default: `checkpoint` itself; an exported folder passes its source). A LoRA run's folder
    holds its adapter instead: `verify_adapter`.
    """
    from safetensors import safe_open

    checkpoint = Path(checkpoint)
    if holds_adapter(checkpoint):
        return verify_adapter(checkpoint, shapes_from=shapes_from)
    files = _weight_files(checkpoint)
    if not files:
        return ["no model.safetensors (16-bit weights gathering is on, so the Trainer should have written it)"]
    saved: dict[str, tuple[int, ...]] = {}
    for path in files:
        if not path.is_file():
            return [f"weight shard {path.name} is missing"]
        try:
            with safe_open(path, framework="pt") as f:
                saved.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        except Exception as e:  # safetensors raises its own error types for a truncated header
            return [f"{path.name} is unreadable ({e})"]
    source = Path(shapes_from or checkpoint)
    expected, tied = param_shapes(source) if (source / "latest").is_file() else ({}, {})
    expected = {n: shape for n, shape in expected.items() if n not in tied}
    if any(n not in saved for n in expected):  # transformers saves some models in another layout than in memory
        expected = saved_shapes(source, expected)
    problems = [f"{name}: saved with shape {saved[name]} (no values)" for name in saved if 0 in saved[name]]
    missing = [n for n in expected if n not in saved]
    wrong = [n for n in expected if n in saved and saved[n] != expected[n]]
    if missing:
        problems.append(f"{len(missing)} trained parameter(s) missing from the weights, e.g. {missing[0]}")
    problems += [f"{n}: shape {saved[n]} in the weights, {expected[n]} trained" for n in wrong[:3]]
    return problems


def verify_checkpoint(checkpoint: str | os.PathLike) -> list[str]:
    """Every problem that keeps a DeepSpeed `checkpoint` from being resumed (empty list: complete).

    The full check the guard runs after a save, for a folder without a marker. World size and whether 16-bit
    weights were gathered come from what DeepSpeed recorded in rank 0's model states.
    """
    import torch

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        return [f"{checkpoint} is not a folder"]
    tag_dir, problems = deepspeed_tag_dir(checkpoint)
    if tag_dir is None:
        return problems
    shards, _ = model_states_files(tag_dir, 0)
    if not shards or _zip_problem(shards[0]):
        return [f"rank 0: no readable model_states shard in {tag_dir.name}"]
    try:
        states = torch.load(shards[0], map_location="cpu", weights_only=True, mmap=True)
        gathered = weights_gathered(states.get("ds_config"))
        for rank in range(states["dp_world_size"]):
            problems += verify_rank_files(checkpoint, rank, states["dp_world_size"])
        problems += verify_shared_files(checkpoint, weights=gathered)
    except OSError as e:  # a file vanished while we looked (another rank cleaning up)
        problems.append(f"unreadable: {e}")
    return problems


def verify_shared_files(checkpoint: str | os.PathLike, weights: bool) -> list[str]:
    """Problems with the files rank 0 writes: trainer state (with the right step) and the 16-bit weights."""
    checkpoint = Path(checkpoint)
    problems = []
    state_file = checkpoint / "trainer_state.json"
    try:
        step = json.loads(state_file.read_text())["global_step"]
        if step != checkpoint_step(checkpoint):
            problems.append(f"trainer_state.json says step {step}, the folder says {checkpoint_step(checkpoint)}")
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"trainer_state.json is missing or unreadable ({e})")
    if weights:
        problems += verify_weights(checkpoint)
    return problems


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(checkpoint: str | os.PathLike, info: dict, hashes: dict[str, str] | None = None) -> Path:
    """Flush every file of the checkpoint to disk, then write the marker atomically (tmp + fsync + rename).

    `hashes`: checksums the ranks already computed of their own files (`hash_files`); the rest is hashed here.
    """
    checkpoint = Path(checkpoint)
    hashes = dict(hashes or {})
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name not in (MARKER, SAVING)):
        _fsync(path)
        name = str(path.relative_to(checkpoint))
        files[name] = {"size": path.stat().st_size, HASH: hashes.get(name) or file_hash(path)}
    for folder in {p.parent for p in checkpoint.rglob("*")} | {checkpoint}:
        _fsync(folder)
    record = {"step": checkpoint_step(checkpoint), **info, "bytes": sum(f["size"] for f in files.values()),
              "files": files}
    tmp = checkpoint / f".{MARKER}.tmp"
    with tmp.open("w") as f:
        json.dump(record, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / MARKER)
    (checkpoint / SAVING).unlink(missing_ok=True)
    _fsync(checkpoint)
    return checkpoint / MARKER


def read_marker(checkpoint: str | os.PathLike) -> dict | None:
    """The marker's record, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(checkpoint) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _listed(record: dict) -> dict[str, dict]:
    """The marker's files as {name: {"size": ..., "xxh3_64": ...}}; markers before checksums held sizes only."""
    return {name: entry if isinstance(entry, dict) else {"size": entry}
            for name, entry in record.get("files", {}).items()}


def missing_files(checkpoint: str | os.PathLike, record: dict) -> list[str]:
    """Files the marker lists that are gone or changed size (cheap: stats only)."""
    root, problems = Path(checkpoint), []
    for name, entry in _listed(record).items():
        path = root / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, the marker says {entry['size']}")
    return problems


def is_complete(checkpoint: str | os.PathLike) -> bool:
    """The marker is there and every file it lists is still there with its size (cheap: stats only; resume also
    compares checksums, `verify_complete`)."""
    record = read_marker(checkpoint)
    return (record is not None and record.get("step") == checkpoint_step(checkpoint)
            and not (Path(checkpoint) / FAILED).exists() and not missing_files(checkpoint, record))


def verify_complete(checkpoint: str | os.PathLike, rank: int = 0, world_size: int = 1, writer: int = 0) -> list[str]:
    """Problems with the files of a marked checkpoint that `rank` owns: missing, another size, another checksum.

    Every rank checks its share (together: every file, once), so a truncated or flipped shard is caught before
    DeepSpeed opens it. Markers written before checksums are checked by size alone. `writer`: see `file_owner`.
    """
    record = read_marker(checkpoint)
    if record is None:
        return ["no completion marker"]
    root, problems = Path(checkpoint), []
    for name, entry in _listed(record).items():
        if file_owner(name, world_size, writer) != rank:
            continue
        path = root / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, the marker says {entry['size']}")
        elif HASH in entry and file_hash(path) != entry[HASH]:
            problems.append(f"{name} is corrupted (its checksum differs from the one written at save time)")
    return problems


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in output_dir, oldest step first."""
    return [p for p in list_checkpoints(output_dir) if is_complete(p)]


def newest_complete(output_dir: str | os.PathLike) -> Path | None:
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def remove_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Delete a checkpoint folder: rename it to `.deleting-checkpoint-N` first (atomic), so a kill mid-delete
    leaves no half-deleted `checkpoint-N` that looks like a checkpoint; then delete. A symlinked checkpoint loses
    only the link (we never delete outside output_dir)."""
    path = Path(checkpoint)
    doomed = path.with_name(f"{DELETING}{path.name}")
    if doomed.exists() or doomed.is_symlink():
        _delete(doomed)  # an earlier rotation of the same step that a kill interrupted
    path.rename(doomed)
    _delete(doomed)


def _delete(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def finish_deletions(output_dir: str | os.PathLike) -> list[Path]:
    """Finish the deletions a killed rotation left (`.deleting-checkpoint-N` folders); returns them."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    left = sorted(p for p in root.iterdir() if p.name.startswith(DELETING) and checkpoint_step(p.name[len(DELETING):])
                  is not None)
    for path in left:
        _delete(path)
    return left


def read_run_id(output_dir: str | os.PathLike) -> str | None:
    """The id of the run that owns output_dir, or None when no hf_zero3 run started there."""
    try:
        return json.loads((Path(output_dir) / RUN_ID).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim_output_dir(output_dir: str | os.PathLike, run_id: str | None = None) -> str:
    """The output_dir's run id, created (atomically) when this is the first run there: `run_id` (the id node 0's
    copy holds, for a node-local copy) or a new one. One rank per folder."""
    existing = read_run_id(output_dir)
    if existing is not None:
        return existing
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / RUN_ID, {"run_id": run_id or uuid.uuid4().hex,
                                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return read_run_id(root)


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        json.dump(record, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_saving(checkpoint: str | os.PathLike, run_id: str | None = None) -> None:
    """Before a save: flag the folder as this run's and unfinished, and drop an old marker that would otherwise
    vouch for a half-rewritten checkpoint. `run_id`: the output_dir's (default: read from it)."""
    checkpoint = Path(checkpoint)
    checkpoint.mkdir(parents=True, exist_ok=True)
    run_id = run_id or read_run_id(checkpoint.parent)
    (checkpoint / MARKER).unlink(missing_ok=True)
    _write_json(checkpoint / SAVING, {"run_id": run_id, "step": checkpoint_step(checkpoint),
                                      "note": "a save into this folder started; hf_zero3_complete.json marks its end"})


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


def _read_json(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _saving_record(checkpoint: Path) -> dict | None:
    return _read_json(checkpoint / SAVING)


def mark_failed(checkpoint: str | os.PathLike, problems: str) -> None:
    """Record that a marked checkpoint failed verification (rank 0): it counts as damaged from now on."""
    _write_json(Path(checkpoint) / FAILED, {"problems": problems, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                            "note": "its files no longer match the checksums written at save "
                                                    "time; hf_zero3 neither resumes from it nor deletes it"})


def classify(checkpoint: str | os.PathLike, run_id: str | None) -> Found:
    """What a `checkpoint-N` folder is (stats only). `run_id`: the output_dir's (see `claim_output_dir`)."""
    path = Path(checkpoint)
    record = read_marker(path)
    if record is not None:
        if (failed := _read_json(path / FAILED)) is not None:
            return Found(path, "damaged", f"failed verification on {failed.get('at')}: {failed.get('problems')}")
        if record.get("step") != checkpoint_step(path):
            return Found(path, "damaged", f"its marker is for step {record.get('step')}")
        problems = missing_files(path, record)
        if problems:
            return Found(path, "damaged", f"marked complete, but {'; '.join(problems[:3])}")
        return Found(path, "complete", ours=run_id is not None and record.get("run_id") == run_id)
    saving = _saving_record(path)
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


def read_finished(output_dir: str | os.PathLike) -> dict | None:
    return _read_json(Path(output_dir) / FINISHED)


def write_finished(output_dir: str | os.PathLike, record: dict) -> None:
    """After the final model and metrics are written: the run is done (rank 0)."""
    _write_json(Path(output_dir) / FINISHED, {**record, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def clear_finished(output_dir: str | os.PathLike) -> None:
    """Training starts (again): output_dir is no longer a finished run until it ends."""
    (Path(output_dir) / FINISHED).unlink(missing_ok=True)
