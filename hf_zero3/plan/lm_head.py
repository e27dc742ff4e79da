"""The LM head and loss as each trainer computes them: which one a run builds, and what TRL's fused LM head holds.

Why its own module: the logits were planned whole (t x 12 B x vocab: 1.5 MB a token at a 128K vocabulary), but
TRL's SFT, DPO and KTO trainers add a fused LM head (`trl.trainer.utils.add_fused_lm_head`) and compute the loss
through it: the logits in tiles of 4096 tokens x 32768 vocabulary entries, folded into running log-sum-exp
statistics, recomputed in backward, never whole. ORPO and SimPO (TRL's experimental trainers) and transformers' own
Trainer (the runs that measured the planner's calibration) still build the whole logits, or Liger's fused linear
cross-entropy where it is on.
"""

from __future__ import annotations

from hf_zero3.plan.types import Training

TOKEN_TILE = 4096
"""Tokens per projection tile: `trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE` (TRL 1.16)."""
VOCAB_TILE = 32768
"""Vocabulary entries per tile: `trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE`. The tile buffer is allocated this
wide whatever the vocabulary (`torch.empty((min(N, TOKEN_TILE), chunk_size))`): a small vocabulary pays for it too."""
PER_TOKEN_BYTES = 32
"""Per token beside the hidden size: the int64 label, the fp32 log-normaliser, entropy and log-prob gradient kept for
backward, and the trainer's fp32 log-prob and entropy outputs (bytes of a few vectors of the sequence's length)."""

FUSED_STAGES = ("sft", "dpo", "kto")
"""The stages whose TRL trainer computes the loss through the fused LM head (ORPO's and CPO/SimPO's build logits)."""


def fused(training: Training) -> bool:
    """Whether the run computes its loss through TRL's fused LM head: an SFT, DPO or KTO stage on TRL's trainer."""
    stage = training.preference.stage if training.preference is not None else "sft"
    return training.trainer == "trl" and stage in FUSED_STAGES


def fused_bytes(tokens: int, hidden: int, vocab: int, element: int, head_trains: bool) -> tuple[int, str]:
    """TRL's fused LM head at its peak, the end of its backward, and the formula: the tile buffer (the compute
    precision, `element` bytes), the gradient of the hidden states accumulated in fp32 and its cast to the training
    precision, the copy of the hidden states the forward keeps (its valid positions, gathered), the per-token vectors,
    and, when the lm_head trains, its gradient accumulated in fp32 (its cast is the module's gradient, which the
    gathered-gradients term counts). In fp32 the casts are the same tensors."""
    tile = element * min(tokens, TOKEN_TILE) * VOCAB_TILE
    cast = element if element != 4 else 0
    head = 4 * vocab * hidden if head_trains else 0
    formula = (f"a {min(tokens, TOKEN_TILE)} x {VOCAB_TILE} tile of {element}-byte logits + {tokens} tokens x "
               f"((4 + {cast} + {element}) B x {hidden} (fp32 input grad, its cast, the kept input) + "
               f"{PER_TOKEN_BYTES} B)" + (f" + 4 B x vocab {vocab} x {hidden} (lm_head grad in fp32)" if head_trains
                                          else " (frozen lm_head: no grad)"))
    return tile + tokens * per_token_bytes(hidden, element) + head, formula


def per_token_bytes(hidden: int, element: int) -> int:
    """Bytes a token adds to the fused LM head (the tile and the lm_head's gradient are fixed)."""
    return (4 + (element if element != 4 else 0) + element) * hidden + PER_TOKEN_BYTES


def freed_per_token(held: int, tokens: int, hidden: int, element: int) -> int:
    """The fused head's bytes, per token, that are freed before the layers' backward starts: all it holds but the
    input gradient in the training precision, which goes on into the layers (backward's working set counts only what
    it needs beyond them, as it does with the whole logits)."""
    return max(0, held - (element if element != 4 else 0) * tokens * hidden) // tokens
