"""`tiled_compute: true`: the MLPs and the logits+loss computed in tiles along the sequence, with DeepSpeed's
`sequence_tiled_compute` (Arctic Long Sequence Training; `TiledMLP` is its MLP-only form).

Why: at long sequences the largest activations are not attention's but the MLP's intermediate (seq x
intermediate_size, ~3.5x the hidden state, several copies) and the logits (seq x vocab in fp32: 128K tokens of a
128K vocabulary are 64 GiB). Tiled, only one tile of each exists at a time; the tile is recomputed in backward, and
ZeRO-3 is told to reduce a weight's gradient only after the last tile (`ds_grad_is_ready`). The loss is the sum of
the tiles' summed cross-entropies over the same denominator transformers' loss uses, so losses and gradients are
those of the untiled model. Works on one GPU and with sequence parallelism (each rank tiles its shard).

Not `TiledMLP` itself: it splits with `torch.chunk`, which yields fewer tiles than asked for some lengths, and ranks
whose lengths differ would then gather ZeRO-3 weights a different number of times; `sequence_tiled_compute` always
runs the agreed number of tiles.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from hf_zero3.run.arguments import UsageError

IGNORE = -100

LOGITS_TILE_BYTES = 1 << 30
"""Default tile of the loss: at most this many bytes of fp32 logits at a time."""


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


def tile_loss(causal_lm, tile_tokens: int | None) -> None:
    """Replace a causal LM's training forward: the decoder runs as before, then the logits and the cross-entropy
    in tiles; no logits are returned (the Trainer reads only the loss in training). Evaluation and generation keep
    the model's own forward."""
    forward, lm_head = causal_lm.forward, causal_lm.get_output_embeddings()
    vocab = causal_lm.config.get_text_config().vocab_size

    def loss_of_tile(x, y):
        logits = lm_head(x).float()
        return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), ignore_index=IGNORE, reduction="sum")

    @functools.wraps(forward)  # the Trainer keeps the dataset columns the forward's signature names
    def tiled_forward(input_ids=None, labels=None, **kwargs):
        if not (causal_lm.training and torch.is_grad_enabled()) or (labels is None and "shift_labels" not in kwargs):
            return forward(input_ids=input_ids, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        shift_labels, items = kwargs.pop("shift_labels", None), kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        outputs = causal_lm.model(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        if shift_labels is None:  # as transformers' ForCausalLMLoss: predict the next token
            shift_labels = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        batch, seq = shift_labels.shape
        per_tile = tile_tokens or max(1, LOGITS_TILE_BYTES // (4 * vocab * batch))
        tiles = agreed(max(1, math.ceil(seq / per_tile)))
        params = [p for p in lm_head.parameters() if p.requires_grad]
        total = _tiled(loss_of_tile, {"x": hidden, "y": shift_labels}, seq, tiles, "x", params, "sum")
        count = items if items is not None else (shift_labels != IGNORE).sum()
        if torch.is_tensor(count):
            count = count.to(total.device)
        return CausalLMOutputWithPast(loss=total / count, logits=None)

    causal_lm.forward = tiled_forward


def enable(model, tile_tokens: int | None = None) -> int:
    """Tile every decoder MLP and the loss of `model` (the model peft wraps, in a LoRA run); returns the number of
    MLPs tiled. Raises ValueError for a model whose MLPs or decoder it cannot find."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    mlps = [m for name, m in base.named_modules() if name.endswith(".mlp") and type(m).__name__.endswith("MLP")]
    if not mlps or not hasattr(base, "model") or base.get_output_embeddings() is None:
        raise ValueError(f"tiled_compute: {type(base).__name__} has no decoder MLPs (modules named mlp) or no lm_head "
                         "to tile; set tiled_compute false")
    for mlp in mlps:
        tile_mlp(mlp, tile_tokens)
    tile_loss(base, tile_tokens)
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
            "hidden-size tokens for the MLPs, <= 1 GiB of fp32 logits for the loss"
        print(f"hf_zero3: tiled compute on: {count} MLPs and the logits+loss in tiles of {size} along the sequence "
              "(recomputed in backward)", flush=True)
