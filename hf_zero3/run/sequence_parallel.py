"""Ulysses sequence parallelism (DeepSpeed's Arctic Long Sequence Training) put into a run through the stock path.

`sequence_parallel_size: N` becomes `TrainingArguments.parallelism_config = ParallelismConfig(sp_backend="deepspeed",
sp_size=N)`: Accelerate wraps the model's attention in DeepSpeed's `UlyssesSPAttentionHF` (an all-to-all swaps the
sequence shards for head shards), the Trainer wraps the data loader in `UlyssesSPDataLoaderAdapter` (each batch
split along the sequence) and computes the loss over the group (`deepspeed_sp_compute_loss`). What we add: the
checks before start, a collator that hands the adapter what it needs (position_ids, a length that divides by N),
and, for packed data under SDPA, the mask that keeps packed examples apart (Ulysses drops the model's mask and
gathers the position_ids; flash attention reads the examples' boundaries from those, SDPA needs a mask built from
them).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import torch
from packaging.version import Version

from hf_zero3.config.check import load_config
from hf_zero3.data.packing import attention_of as kernel_of
from hf_zero3.data.packing import flattens
from hf_zero3.job.arguments import UsageError

ATTENTIONS = ("sdpa", "flash_attention_2", "flash_attention_3")
"""Attention kernels Ulysses wraps (Accelerate's list; eager and flex need a full-length mask it cannot shard)."""

REDUCE_SCATTER_NEEDED_BEFORE = Version("0.20.2")
"""DeepSpeed before this leaves some ZeRO-3 gradients scaled by N under sequence parallelism unless
`zero_optimization.reduce_scatter` is true (transformers refuses the run at `train()`; we say so before start)."""

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Flash attention's precomputed boundaries: whole-sequence values the adapter cannot shard; after the gather the
kernel finds the same boundaries from the position_ids."""

def size_of(values: dict[str, Any]) -> int:
    size = values.get("sequence_parallel_size")
    return 1 if size is None else int(size)


def problems(values: dict[str, Any], world_size: int | None, ds_config: dict | None) -> list[str]:
    """Every reason a `sequence_parallel_size` run would fail or train wrong, one line each naming the fix."""
    sp = size_of(values)
    if sp < 1:
        return [f"sequence_parallel_size must be >= 1 (got {sp}): 1 turns sequence parallelism off"]
    if sp == 1:
        return []
    out = []
    if world_size is not None and world_size % sp:
        out.append(f"sequence_parallel_size {sp} does not divide the world size {world_size}: each group of {sp} "
                   f"ranks shares one sequence; launch a multiple of {sp} ranks or set sequence_parallel_size to a "
                   f"divisor of {world_size}")
    block = int(values.get("block_size") or 0)
    if block and block % sp:
        out.append(f"block_size {block} does not divide by sequence_parallel_size {sp}: each rank holds block_size / "
                   f"{sp} tokens of a sequence; set block_size to a multiple of {sp} (e.g. {block - block % sp})")
    attention = values.get("attn_implementation")
    if attention is not None and attention not in ATTENTIONS and not _hub_flash(attention):
        out.append(f"attn_implementation {attention} cannot be wrapped by Ulysses sequence parallelism (it needs a "
                   f"full-length mask): set attn_implementation sdpa (or flash_attention_2 on GPUs)")
    stage = values.get("stage") or "sft"
    if stage != "sft":
        out.append(f"sequence_parallel_size {sp} runs with stage sft only (TRL's {stage} trainer does not shard its "
                   "pairs along the sequence): set sequence_parallel_size 1, or train stage sft")
    if not values.get("deepspeed"):
        out.append(f"sequence_parallel_size {sp} needs DeepSpeed: set deepspeed to a ds_config (e.g. "
                   "recipes/tiny/ds_config.json)")
    elif (problem := reduce_scatter_problem(ds_config, sp)) is not None:
        out.append(problem)
    return out


def problems_of(values: dict[str, Any], world_size: int | None) -> list[str]:
    """`problems` with the run's ds_config read from `deepspeed` (a path or a dict); an unreadable one is the ds_config
    check's to report."""
    source = values.get("deepspeed") if size_of(values) > 1 else None
    try:
        ds_config = load_config(source) if isinstance(source, str) else source
    except (FileNotFoundError, ValueError):
        ds_config = None
    return problems(values, world_size, ds_config)


def _hub_flash(attention: str) -> bool:
    return "/" in attention and "flash-attn" in attention  # a hub kernel such as kernels-community/flash-attn2


def reduce_scatter_problem(ds_config: dict | None, sp: int, deepspeed_version: str | None = None) -> str | None:
    """transformers' own refusal, said before start: ZeRO-3 with `reduce_scatter: false` (and contiguous gradients)
    on DeepSpeed < 0.20.2 leaves gradients scaled by the sequence-parallel size."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    if zero.get("stage") != 3 or zero.get("reduce_scatter", True) or not zero.get("contiguous_gradients", True):
        return None
    installed = Version(deepspeed_version or version("deepspeed"))
    if installed >= REDUCE_SCATTER_NEEDED_BEFORE:
        return None
    return (f"ds_config zero_optimization.reduce_scatter is false: with sequence_parallel_size {sp} on ZeRO-3, "
            f"DeepSpeed {installed} (< {REDUCE_SCATTER_NEEDED_BEFORE}) leaves gradients scaled by {sp}; set "
            f"reduce_scatter true (or upgrade deepspeed to >= {REDUCE_SCATTER_NEEDED_BEFORE})")


def parallelism_config(sp: int, attention: str):
    """The stock ParallelismConfig for DeepSpeed's Ulysses, naming the attention kernel the model runs."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_attn_implementation=attention, sp_seq_length_is_variable=True))


class ShardableCollator:
    """The run's collator, its batches made ready for the sequence-sharding data loader: flash attention's
    whole-sequence boundaries dropped. TRL's collator does the rest: position_ids (SFTTrainer asks for them under
    sequence parallelism) and the length padded to a multiple of the sequence-parallel size (`pad_to_multiple_of`,
    set by `run.sft.as_sft_config`: labels -100, positions 0)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features: list[dict]) -> dict:
        batch = dict(self.collator(features))
        for key in VARLEN_KEYS:
            batch.pop(key, None)
        return batch


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within each packed example: a new example starts wherever the position is 0. Shape
    [batch, 1, seq, seq], True where a query may attend to a key."""
    example = (position_ids == 0).cumsum(dim=-1)
    same = example[:, :, None] == example[:, None, :]
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def keep_packed_examples_apart() -> None:
    """SDPA, as Ulysses calls it: with no mask (Ulysses drops the model's, built for one shard) and the gathered
    position_ids of packed examples, attend within each example only. Registered before the Trainer prepares the
    model, so DeepSpeed's wrapper calls this one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def packed_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
        positions = kwargs.get("position_ids")
        if attention_mask is None and positions is not None and positions.shape[-1] == query.shape[2] \
                and bool((positions[:, 1:] == 0).any()):
            attention_mask = document_mask(positions)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = packed_sdpa


def attention_of(model) -> str:
    """The attention kernel the model runs (the model peft wraps, in a LoRA run)."""
    return kernel_of(model.get_base_model() if hasattr(model, "peft_config") else model)


def prepare(model, training_args, packed: bool) -> None:
    """Put sequence parallelism into the run before the Trainer is built: the checks, the ParallelismConfig on the
    TrainingArguments (the Trainer's accelerator reads it when built), packed SDPA kept apart."""
    sp = training_args.sequence_parallel_size
    if sp <= 1:
        return
    attention = attention_of(model)
    if attention not in ATTENTIONS and not _hub_flash(attention):
        raise UsageError(f"the model runs {attention} attention, which Ulysses sequence parallelism cannot wrap: set "
                         "attn_implementation sdpa (or flash_attention_2 on GPUs)")
    if packed and flattens(attention) and training_args.per_device_train_batch_size > 1:
        raise UsageError(f"packed data under {attention} is flattened into one row per micro batch, and Ulysses "
                         "sequence parallelism takes rows of the micro batch's size: set per_device_train_batch_size "
                         "1 (a longer block_size holds the same tokens)")
    training_args.parallelism_config = parallelism_config(sp, attention)
    if packed and attention == "sdpa":
        keep_packed_examples_apart()
    if training_args.process_index == 0:
        print(describe(training_args, attention, packed), flush=True)


def shard_batches(trainer) -> None:
    """The Trainer's collator made shardable for the sequence-sharding data loader (nothing without sequence
    parallelism)."""
    if getattr(trainer.args, "sequence_parallel_size", 1) > 1:
        trainer.data_collator = ShardableCollator(trainer.data_collator)


def resumable(trainer) -> None:
    """Resuming mid-epoch skips the batches already trained; accelerate's `skip_first_batches` cannot skip on the
    sequence-sharding loader (it reads the wrapped loader's dataset), so the skip goes to the wrapped loader: whole
    groups of N micro batches there, the rest through the new adapter. Set through the Trainer's documented
    `get_resumed_dataloader` hook, on this Trainer only."""
    if getattr(trainer.args, "sequence_parallel_size", 1) <= 1:
        return
    stock = trainer.get_resumed_dataloader

    def skip(dataloader, num_batches):
        from accelerate.data_loader import skip_first_batches
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        if not isinstance(dataloader, UlyssesSPDataLoaderAdapter):
            return stock(dataloader, num_batches)
        groups, rest = divmod(num_batches, dataloader.sp_world_size)
        adapter = UlyssesSPDataLoaderAdapter(skip_first_batches(dataloader.dl, groups), sp_rank=dataloader.sp_rank,
                                             sp_group=dataloader.sp_group, sp_world_size=dataloader.sp_world_size,
                                             device=dataloader.device)
        for _ in range(rest):
            next(adapter)
        return adapter

    trainer.get_resumed_dataloader = skip


def describe(training_args, attention: str, packed: bool) -> str:
    """The line said at start: the group, the data-parallel size it leaves, and what that means for the batch."""
    sp, world = training_args.sequence_parallel_size, training_args.world_size
    line = (f"hf_zero3: sequence parallel {sp} (Ulysses, {attention}): each sequence split over {sp} ranks, "
            f"{world // sp} data-parallel; the global batch counts the data-parallel ranks' sequences only (the same "
            f"global batch needs {sp}x the accumulation of {world} plain data-parallel ranks), and the learning rate "
            "goes with the global batch, not the rank count")
    if packed and attention == "sdpa":
        line += ("; packed examples kept apart by a mask built from the gathered position_ids (sequence² bytes per "
                 "layer: flash_attention_2 needs none)")
    return line
