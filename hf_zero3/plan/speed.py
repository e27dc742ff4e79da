"""Measured training speed: which of two fitting ZeRO stages (or checkpointing or not) is faster, and the report that
says so.

Why measurements: memory says what fits, not what is fast. On 2 x H200 with the 8B shape ZeRO-2 at micro 1 ran faster
than stock ZeRO-3 at micro 2, yet ZeRO-3 + Liger at micro 3 ran faster than ZeRO-2: no rule of thumb orders them,
only a measurement. Speeds vary between machines by more than those gaps for one config, so two stages are compared
only through rows of one source (one machine, one sitting).

`fastest` gets the fitting plans of the cheapest memory tier (same offload and checkpointing) in `cost_key` order and
returns one with the reason; `faster_measured` then weighs that against the best plan with checkpointing, when one
source measured both exactly (on one GPU a larger micro batch can outrun the recompute). Pure arithmetic over the
rows of `measured.json` (`plan.calibration`), each of which names the report it is from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from hf_zero3.plan import calibration

if TYPE_CHECKING:
    from hf_zero3.plan.memory import Hardware, Plan
    from hf_zero3.plan.shapes import ModelShape

GIB = 2**30
PARAMS_TOLERANCE = 0.10
"""A measurement applies to shapes within 10% of its parameter count (same sequence length)."""
GPU_MEM_TOLERANCE = 0.05
"""... and to GPUs within 5% of its memory, in the same number (140 GiB: H200; 80 GiB would be H100/A100)."""


@dataclass(frozen=True)
class Measurement:
    """One measured configuration: median tokens/s per GPU of a `hf-zero3 bench` run, and the report it is from."""

    params: int
    seq_len: int
    gpus: int
    gpu_mem_gib: float
    stage: int
    liger: bool
    checkpointing: bool
    micro_batch: int
    tokens_per_s: float
    source: str
    config: str
    """The row's name in the report, and what it ran."""
    checkpointed_layers: int | None = None
    """With checkpointing: only the first N layers (`gradient_checkpointing_layers`); None: all."""

    def applies(self, shape: ModelShape, hardware: Hardware, seq_len: int) -> bool:
        return (abs(shape.params / self.params - 1) <= PARAMS_TOLERANCE and seq_len == self.seq_len
                and hardware.world_size == self.gpus
                and abs(hardware.gpu_mem / GIB / self.gpu_mem_gib - 1) <= GPU_MEM_TOLERANCE)

    def describe(self) -> str:
        liger = " + Liger" if self.liger else ""
        ckpt = _checkpointing(self.checkpointing, self.checkpointed_layers)
        return f"ZeRO-{self.stage}{liger}{ckpt} micro {self.micro_batch}: {self.tokens_per_s:,.0f} tokens/s/GPU"


def _checkpointing(on: bool, layers: int | None) -> str:
    return (" + checkpointing" + (f" (first {layers} layers)" if layers else "")) if on else ""


def study(source: str) -> str:
    """A report's study, as the benchmarks index names it: its results folder without the date."""
    for part in PurePosixPath(source).parts:
        if part[:4].isdigit() and "_" in part:
            return part.split("_", 1)[1]
    return PurePosixPath(source).stem


def _measurement(row: dict) -> Measurement:
    return Measurement(row["params"], row["seq_len"], row["gpus"], row["gpu_mem_gib"], row["stage"], row["liger"],
                       row["checkpointing"], row["micro_batch"], row["tokens_per_s_per_gpu"], row["source"],
                       f"{row['row']}: {row['config']}", row["checkpointed_layers"])


MEASURED: tuple[Measurement, ...] = tuple(_measurement(r) for r in calibration.speeds())
"""tokens/s/GPU by (model class, hardware, ZeRO stage, Liger, checkpointing, micro batch), from measured.json. FSDP2
is not a ZeRO option, so it is not there."""


def _match(plan: Plan, rows: list[Measurement]) -> tuple[int, Measurement] | None:
    """The row of `rows` that best describes `plan`'s speed, with how closely: 2 = same Liger and micro batch; 1 = same
    Liger, a smaller micro batch; 0 = without Liger for a plan with it. Only rows with no more of the speed settings
    than the plan count (Liger, a larger micro batch would flatter it), so a row that is not exact is a lower bound."""
    t, spec = plan.training, plan.spec
    same = [m for m in rows if m.stage == spec.stage and m.checkpointing == spec.activation_checkpointing
            and m.checkpointed_layers == spec.checkpointed_layers
            and (t.liger or not m.liger) and m.micro_batch <= t.micro_batch]
    scored = [((m.liger == t.liger) + (m.liger == t.liger and m.micro_batch == t.micro_batch), m) for m in same]
    return max(scored, key=lambda x: (x[0], x[1].tokens_per_s), default=None)


def fastest(tier: list[Plan], shape: ModelShape, hardware: Hardware, seq_len: int,
            table: tuple[Measurement, ...] = MEASURED) -> tuple[Plan, str]:
    """The plan to run among `tier` (fitting plans of one offload/checkpointing tier, in `cost_key` order: lower
    stage first, then the largest micro batch), and why.

    Each stage runs at its largest fitting micro batch. When ZeRO-2 and ZeRO-3 both fit, the faster by one source's
    measurements for this model class and hardware wins (the source with the closest matches); without one, the
    memory-only order stands (the lower stage: no per-layer gathers), and the reason says so.
    """
    by_stage: dict[int, Plan] = {}
    for p in tier:
        by_stage.setdefault(p.spec.stage, p)
    first = tier[0]
    if len(by_stage) < 2:
        ckpt, offload = first.spec.activation_checkpointing, "offload" in first.label
        if not (ckpt or offload):
            return first, f"only ZeRO-{first.spec.stage} fits without offload or checkpointing"
        lighter = " or ".join(x for x, on in (("with less offload", offload), ("without checkpointing", ckpt)) if on)
        return first, f"{first.label} is the fastest option that fits: nothing {lighter} does"
    rows = [m for m in table if m.applies(shape, hardware, seq_len)]
    best_file, best = None, None
    for source in dict.fromkeys(m.source for m in rows):
        matches = {s: _match(p, [m for m in rows if m.source == source]) for s, p in by_stage.items()}
        if all(matches.values()):
            closeness = sum(score for score, _ in matches.values())
            if best is None or closeness > best[0]:
                best_file, best = source, (closeness, matches)
    stages = " and ".join(f"ZeRO-{s} (micro {p.training.micro_batch})" for s, p in by_stage.items())
    if best is None:
        return first, (f"{stages} both fit; no measurement of both for this model class on {hardware.world_size} "
                       f"GPU(s) of {hardware.gpu_mem / GIB:.0f} GiB (hf_zero3/plan/measured.json), so the memory-only "
                       f"order: ZeRO-{first.spec.stage} first")
    matches = best[1]
    winner = max(matches, key=lambda s: matches[s][1].tokens_per_s)
    plan = by_stage[winner]
    said = []
    for s, (score, m) in sorted(matches.items(), key=lambda x: -x[1][1].tokens_per_s):
        p = by_stage[s]
        want = f"ZeRO-{s}{' + Liger' if p.training.liger else ''} micro {p.training.micro_batch}"
        said.append(m.describe() + ("" if score == 2 else f" (for {want}: not measured, a lower bound)"))
    return plan, f"ZeRO-{winner} by measured speed: " + " vs ".join(said) + f" (study {study(best_file)})"


def _describe(p: Plan) -> str:
    ckpt = _checkpointing(p.spec.activation_checkpointing, p.spec.checkpointed_layers)
    return f"ZeRO-{p.spec.stage}{' + Liger' if p.training.liger else ''}{ckpt} micro {p.training.micro_batch}"


def _more_recompute(plan: Plan, rows: list[Measurement]) -> Measurement | None:
    """A lower bound for a plan that checkpoints only its first layers: the row of the same stage, Liger and micro
    batch that checkpointed the fewest layers at least as many as the plan (more recompute, the same work else)."""
    t, spec = plan.training, plan.spec
    if not spec.checkpointed_layers:
        return None
    layers = lambda m: m.checkpointed_layers or plan.shape.layers
    bounds = [m for m in rows if m.stage == spec.stage and m.checkpointing and m.liger == t.liger
              and m.micro_batch == t.micro_batch and layers(m) >= spec.checkpointed_layers]
    return min(bounds, key=layers, default=None)


def faster_measured(a: Plan, b: Plan, shape: ModelShape, hardware: Hardware, seq_len: int,
                    table: tuple[Measurement, ...] = MEASURED) -> tuple[Plan, str] | None:
    """The faster of two plans by one source that measured both exactly (stage, Liger, checkpointing, micro
    batch), with why; None without such a source. Why: checkpointing costs a forward's recompute, yet it can win by a
    larger micro batch, as on one H200 where a 7B fits only micro 1 without it (ZeRO-3's per-micro-step cost is paid
    16 times for global batch 16 instead of 2)."""
    rows = [m for m in table if m.applies(shape, hardware, seq_len)]
    for source in dict.fromkeys(m.source for m in rows):
        found = [_match(p, [m for m in rows if m.source == source]) for p in (a, b)]
        if all(f is not None and f[0] == 2 for f in found):
            (_, ma), (_, mb) = found
            winner, loser, mw, ml = (b, a, mb, ma) if mb.tokens_per_s > ma.tokens_per_s else (a, b, ma, mb)
            return winner, (f"{_describe(winner)} by measured speed: {mw.tokens_per_s:,.0f} vs "
                            f"{ml.tokens_per_s:,.0f} tokens/s/GPU for {_describe(loser)} (study {study(source)})")
        exact_a = found[0][1] if found[0] is not None and found[0][0] == 2 else None
        bound = _more_recompute(b, [m for m in rows if m.source == source])
        if exact_a is not None and bound is not None and bound.tokens_per_s > exact_a.tokens_per_s:
            return b, (f"{_describe(b)} by measured speed: at least {bound.tokens_per_s:,.0f} tokens/s/GPU (measured "
                       f"with {bound.checkpointed_layers or 'all'} layers checkpointed: more recompute) vs "
                       f"{exact_a.tokens_per_s:,.0f} for {_describe(a)} (study {study(source)})")
    return None
