"""`tiled_compute: true`: the decoder MLPs computed in tiles along the sequence, with DeepSpeed's
`sequence_tiled_compute` (Arctic Long Sequence Training; `TiledMLP` is its MLP-only form).

Why: at long sequences the largest activations are not attention's but the MLP's intermediate (seq x
intermediate_size, ~3.5x the hidden state, several copies) and the logits (seq x vocab in fp32: 128K tokens of a
128K vocabulary are 64 GiB). Tiled, only one MLP tile exists at a time; the tile is recomputed in backward, and
ZeRO-3 is told to reduce a weight's gradient only after the last tile (`ds_grad_is_ready`), so losses and gradients
are those of the untiled model. Works on one GPU and with sequence parallelism (each rank tiles its shard). The
logits+loss are tiled already: every stage's TRL trainer computes the loss through its fused LM head
(`add_fused_lm_head`: token and vocabulary tiles, recomputed in backward, the full logits never built), which this
leaves in place.

Not `TiledMLP` itself: it splits with `torch.chunk`, which yields fewer tiles than asked for some lengths, and ranks
whose lengths differ would then gather ZeRO-3 weights a different number of times; `sequence_tiled_compute` always
runs the agreed number of tiles.
"""

from __future__ import annotations

import math

import torch

from hf_zero3.job.arguments import UsageError


def agreed(count: int) -> int:
    """The tile count every rank uses (the largest any asks for): under ZeRO-3 each tile gathers the weights, a
    collective every rank must join the same number of times."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())
    return count


def _tiled(fn, tensors: dict, seq: int, tiles: int, grad_key: str, params, reduction):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    return sequence_tiled_compute(fn, seq, tiles, tensors, {}, grad_key, compute_params=params,
                                  output_unshard_dimension=0 if reduction else 1, output_reduction=reduction)


def tile_mlp(mlp, tile_tokens: int | None) -> None:
    """Replace this MLP module's forward by the tiled one (tiles of `tile_tokens` tokens; default: hidden size, as
    DeepSpeed's TiledMLP example does)."""
    forward = mlp.forward

    def tiled_forward(x):
        if not torch.is_grad_enabled() or x.dim() != 3:
            return forward(x)
        seq = x.shape[1]
        tiles = agreed(max(1, math.ceil(seq / (tile_tokens or x.shape[-1]))))
        params = [p for p in mlp.parameters() if p.requires_grad]
        return _tiled(lambda x: forward(x), {"x": x}, seq, tiles, "x", params, None)

    mlp.forward = tiled_forward


def enable(model, tile_tokens: int | None = None) -> int:
    """Tile every decoder MLP of `model` (the model peft wraps, in a LoRA run); returns the number of MLPs tiled.
    Raises ValueError for a model whose MLPs it cannot find."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    mlps = [m for name, m in base.named_modules() if name.endswith(".mlp") and type(m).__name__.endswith("MLP")]
    if not mlps:
        raise ValueError(f"tiled_compute: {type(base).__name__} has no decoder MLPs (modules named mlp) to tile; set "
                         "tiled_compute false")
    for mlp in mlps:
        tile_mlp(mlp, tile_tokens)
    return len(mlps)


def enable_for_run(model, training_args) -> None:
    """`tiled_compute` of a run: tile the model (after the Trainer, whose Liger patches the forwards this wraps) and
    say so on rank 0; a model it cannot tile is a usage error."""
    if not training_args.tiled_compute:
        return
    try:
        count = enable(model, training_args.tiled_compute_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if training_args.process_index == 0:
        size = f"{training_args.tiled_compute_tokens} tokens" if training_args.tiled_compute_tokens else \
            "the hidden size in tokens"
        print(f"hf_zero3: tiled compute on: {count} MLPs in tiles of {size} along the sequence (recomputed in "
              "backward); the logits+loss in TRL's fused LM head's tiles", flush=True)
