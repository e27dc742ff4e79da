"""What a checkpoint folder holds, verified: DeepSpeed's tag folder and each rank's files, the trainer state, the
16-bit weights (every tensor readable, shapes as the model's), and a LoRA adapter's files and keys.

Why: a folder can look saved and still be unusable (a truncated shard, a zip that does not open, weights of
another shape); these checks say which file and why, before a resume or an export opens it.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

from hf_zero3.checkpoint.lifecycle import CheckpointError, checkpoint_step, read_json, weights_gathered
from hf_zero3.checkpoint.names import saved_shapes


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
    saved = read_json(Path(checkpoint) / "config.json")
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
