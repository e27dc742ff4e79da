"""Whether packed examples stay apart in a given model.

TRL packs chat and prompt/completion examples best-fit into `block_size` rows (`trl.pack_dataset`, strategy bfd) and
its collator flattens a micro batch into one row whose `position_ids` restart at 0 for every example, with no
attention mask. transformers turns those position_ids into attention that never crosses an example: flash-attention
kernels run varlen; SDPA, eager and flex attention get a block-diagonal causal mask from `masking_utils`. A model
that builds its mask another way (or keeps a recurrent state) would mix the examples of a row: `packing_problem`
finds that before training starts."""

from __future__ import annotations

import sys

MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")
"""transformers.masking_utils functions that honour packed position_ids."""


def attention_of(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def flattens(attention: str) -> bool:
    """Whether packed rows are flattened into one row per micro batch for this attention kernel (flash attention's
    varlen kernels); other kernels keep each packed row a row."""
    return "flash" in attention


def packing_problem(model_class: type, attention: str) -> str | None:
    """Why packing would let one example attend to another in a model of this class with this attention kernel
    (None: it would not)."""
    if flattens(attention):  # varlen kernels over the flattened row
        return None
    module = sys.modules.get(model_class.__module__)
    if module is not None and any(hasattr(module, name) for name in MASK_BUILDERS):
        return None
    return (f"packing puts several examples in one block, and {model_class.__name__} ({attention} attention) does "
            "not build its attention mask from position_ids, so they would attend to each other (or share a "
            "recurrent state): set packing false (one example per row, padded)")

