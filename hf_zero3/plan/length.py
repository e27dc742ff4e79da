"""The planner for length: which sequence-parallel degree, tiling and offload make a sequence fit, or why none does.

Why its own module: at 32K-128K+ tokens the activations, not the weights, decide what fits, and the levers are
others than the micro batch: Ulysses sequence parallelism (`sequence_parallel_size`) leaves each rank seq/N tokens
of every layer (ZeRO-3 still shards the states over every rank), and tiled compute (`tiled_compute`) keeps one tile
of the MLP's intermediate instead of the whole sequence's. Each (N, tiling) is planned by the memory model at seq/N
tokens per rank through `choose` (checkpointing and offload as it decides them); tiling is planned as Liger's
SwiGLU and RMSNorm, a little more MLP than the tiles keep, so the plan errs high. The logits are never whole with or
without tiling: SFT's TRL trainer computes the loss through its fused LM head (`plan.lm_head`), planned as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hf_zero3.plan import lm_head
from hf_zero3.plan.choose import Choice, choose
from hf_zero3.plan.memory import LOGITS_BYTES_PER_VOCAB, element_bytes, layer_activation_bytes
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.types import Adapter, Hardware, Preference, Training, describe

SP_ATTENTIONS = ("sdpa", "flash_attention_2")
"""Attention kernels Ulysses wraps (eager keeps a full-length mask it cannot shard)."""


def per_token(shape: ModelShape, precision: str, attention: str, tiled: bool, trainer: str = "trl") -> dict[str, int]:
    """Bytes one token keeps for backward: in one decoder layer, and in the logits + loss. Tiled, the MLP's
    intermediate (gate, act, up, product: 4 x ffn) exists one tile at a time, not per token. The logits + loss are
    TRL's fused LM head's, tiled or not (`trainer` "transformers": the whole fp32 logits, planned away by tiling as
    Liger's fused cross-entropy)."""
    b = element_bytes(precision)
    layer = layer_activation_bytes(shape, precision, 1, "sdpa" if attention == "eager" and tiled else attention)
    if tiled:
        layer -= 4 * b * shape.active_ffn
    if trainer == "trl":
        return {"layer": layer, "logits": lm_head.per_token_bytes(shape.hidden, b)}
    return {"layer": layer, "logits": 0 if tiled else LOGITS_BYTES_PER_VOCAB * shape.vocab}


def all_to_all_bytes(shape: ModelShape, seq_len: int, sp: int, precision: str) -> int:
    """Bytes one rank sends per micro batch through Ulysses' all-to-alls: in each layer q, k, v in and the attention
    output back (seq/N tokens, all but 1/N of them to other ranks), forward and again in backward."""
    if sp <= 1:
        return 0
    b, local = element_bytes(precision), seq_len // sp
    per_layer = local * b * (2 * shape.q_dim + 2 * shape.kv_dim) * (sp - 1) // sp
    return 2 * shape.layers * per_layer


def degrees(shape: ModelShape, hardware: Hardware, seq_len: int, attention: str) -> list[int]:
    """Sequence-parallel sizes to try: 1, and powers of two that divide the GPU count, the attention heads and the
    sequence (Ulysses splits the heads over the group)."""
    if attention not in SP_ATTENTIONS:
        return [1]
    out, n = [1], 2
    while n <= hardware.world_size:
        if hardware.world_size % n == 0 and shape.heads % n == 0 and seq_len % n == 0:
            out.append(n)
        n *= 2
    return out


@dataclass(frozen=True)
class LengthOption:
    sp: int
    tiled: bool
    choice: Choice
    all_to_all: int

    @property
    def label(self) -> str:
        return f"sequence_parallel_size {self.sp}, tiled_compute {'true' if self.tiled else 'false'}"


@dataclass(frozen=True)
class LengthPlan:
    seq_len: int
    tried: tuple[LengthOption, ...]
    best: LengthOption | None
    why_not: str = ""


def per_rank(training: Training, sp: int, tiled: bool) -> Training:
    """What one rank of a run with `sequence_parallel_size` sp and `tiled_compute` processes, as the memory model
    plans it: seq/sp tokens of each sequence, tiling planned as Liger's SwiGLU and norms (it errs high)."""
    return dataclasses.replace(training, seq_len=max(1, training.seq_len // max(sp, 1)), liger=training.liger or tiled)


def with_run_args(choice: Choice, sp: int, tiled: bool, liger: bool) -> Choice:
    """The choice's TrainingArguments for the run: tiling in place of the Liger that stood in for it in the plan,
    and the sequence-parallel size."""
    if not choice.fits:
        return choice
    args = {k: v for k, v in choice.training_args.items() if k != "use_liger_kernel" or liger}
    return dataclasses.replace(choice, training_args={**args, **({"sequence_parallel_size": sp} if sp > 1 else {}),
                                                      **({"tiled_compute": True} if tiled else {})})


def plan_length(shape: ModelShape, hardware: Hardware, seq_len: int, *, precision: str = "bf16",
                attention: str = "sdpa", liger: bool = False, adapter: Adapter | None = None,
                load_bytes: int | None = None, preference: Preference | None = None, trainer: str = "trl",
                beyond: tuple[int, bool] | None = None) -> LengthPlan:
    """The least sequence parallelism (least all-to-all traffic), untiled before tiled, that fits one sequence of
    `seq_len` per micro batch; or, when nothing does, what came closest and why. `beyond` (sp, tiled): only options
    with at least as much of both, other than that one (the next step after a run of it ran out of memory). A
    preference stage (`preference`) counts its pairs and reference, and is offered tiling only."""
    tried = []  # sequence parallelism runs stage sft only (a preference trainer does not shard its pairs): tiling
    for sp in degrees(shape, hardware, seq_len, attention) if preference is None else [1]:
        for tiled in (False, True):
            if beyond is not None and (sp < beyond[0] or tiled < beyond[1] or (sp, tiled) == beyond):
                continue
            choice = choose(shape, hardware, seq_len // sp, micro_batch=1, precision=precision, attention=attention,
                            liger=liger or tiled, adapter=adapter, load_bytes=load_bytes, preference=preference,
                            trainer=trainer)
            choice = with_run_args(choice, sp, tiled, liger)
            option = LengthOption(sp, tiled, choice, all_to_all_bytes(shape, seq_len, sp, precision))
            tried.append(option)
            if choice.fits:
                return LengthPlan(seq_len, tuple(tried), option)
    if not tried:
        return LengthPlan(seq_len, (), None, f"no larger sequence_parallel_size or tiling to try for {seq_len} tokens")
    last = tried[-1]
    closest = min((p for o in tried for p in o.choice.tried), key=lambda p: p.gpu_bytes, default=None)
    fix = ("more GPUs (a larger sequence_parallel_size) or a shorter sequence" if preference is None else
           "a shorter sequence (sequence parallelism runs stage sft only)")
    why = (f"nothing fits {seq_len} tokens on {hardware.world_size} GPU(s): the most that was tried ({last.label}), "
           f"at its least GPU memory ({describe(closest.spec)}), still lacks: {'; '.join(closest.problems())}; "
           f"{fix}{'' if closest.fits_host else ', or more host RAM'}") if closest else \
        f"nothing fits {seq_len} tokens: {last.choice.advice}"
    return LengthPlan(seq_len, tuple(tried), None, why)


def report_lines(length: LengthPlan, shape: ModelShape, precision: str, attention: str,
                 trainer: str = "trl") -> list[str]:
    """`plan`'s length section: per-token activations with and without tiling, each degree tried, the answer."""
    plain, tiled = (per_token(shape, precision, attention, t, trainer) for t in (False, True))
    logits = (f"the logits + loss {plain['logits']:,} B (TRL's fused LM head: the logits one {lm_head.TOKEN_TILE} x "
              f"{lm_head.VOCAB_TILE} tile at a time, tiled or not)" if trainer == "trl" else
              f"the logits + loss {plain['logits']:,} B ({tiled['logits']:,} B tiled: one tile at a time)")
    head = (f"length    {length.seq_len} tokens: per token, a layer keeps {plain['layer']:,} B "
            f"({tiled['layer']:,} B tiled), {logits}")
    lines = [head]
    for option in length.tried:
        traffic = f", all-to-all {option.all_to_all / 1e9:.2f} GB per rank per sequence" if option.sp > 1 else ""
        verdict = f"fits: {describe(option.choice.plan.spec)}" if option.choice.fits else "does not fit"
        lines.append(f"length    {option.label} ({length.seq_len // option.sp} tokens per rank){traffic}: {verdict}")
    if length.best:
        lines.append(f"length    chosen: {length.best.label}: the tables above are one rank's "
                     f"{length.seq_len // length.best.sp} tokens; the TrainingArguments line has both")
    else:
        lines.append(f"length    {length.why_not}")
    return lines


def length_json(length: LengthPlan | None) -> dict | None:
    """`plan --json`'s length section (None when the sequence fits without sequence parallelism or tiling)."""
    if length is None:
        return None
    return {"seq_len": length.seq_len, "why_not": length.why_not or None,
            "best": {"sequence_parallel_size": length.best.sp, "tiled_compute": length.best.tiled} if length.best
            else None,
            "tried": [{"sequence_parallel_size": o.sp, "tiled_compute": o.tiled, "fits": o.choice.fits,
                       "all_to_all_bytes": o.all_to_all} for o in length.tried]}
