"""A bench's inputs, checked before any run starts: the recipe, the baselines and their tuned settings, other
recipe folders run like ours, `--only`, and the run's facts every config shares (sequence length, global batch, the
model's line in the report). Each bad input is one `ValueError` naming it and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_zero3.ops.baselines import (
    BASELINES,
    TUNED_SET,
    Search,
    Tuned,
    build_slots,
    expand_against,
    variants_of,
)
from hf_zero3.plan.hardware import default_ranks
from hf_zero3.plan.shapes import load_config_shape
from hf_zero3.recipes import get
from hf_zero3.job.arguments import load_arguments
from hf_zero3.job.facts import RunFacts


@dataclass(frozen=True)
class BenchInputs:
    """What one bench runs, checked."""

    recipe: Path
    against: list[str]
    """The baselines, `tuned` expanded to those that apply to `gpus` ranks."""
    gpus: int
    tuned: dict[str, list[Tuned]]
    others: dict[str, Path]
    """`--variant NAME=FOLDER`: other recipe folders, run like ours."""
    only: frozenset[str]
    extra: list[str]
    """Train overrides for every config (after `--`, and `--peak_tflops`)."""
    seq_len: int
    global_batch: int
    label: str
    model: str
    """The model's line in the report."""


def bench_inputs(recipe: str, *, against: str, gpus: int | None, tuned: list[str], variants: list[str], only: str,
                 overrides: list[str], peak_tflops: float | None, label: str | None) -> BenchInputs:
    """The bench's inputs from its command line's values; ValueError naming the first bad one and its fix."""
    folder = get(recipe).folder
    names = [a for a in against.split(",") if a]
    unknown = [a for a in names if a not in (TUNED_SET, *BASELINES)]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}: choose from {', '.join((TUNED_SET, *BASELINES))}")
    gpus = gpus or default_ranks()
    names = expand_against(names, gpus)
    settings = Tuned.collect(tuned)
    if set(settings) - set(names):
        raise ValueError(f"--tuned sets {sorted(set(settings) - set(names))}, which --against does not run: add them "
                         "to --against")
    others = _variant_folders(variants)
    selected = frozenset(a for a in only.split(",") if a)
    extra = [*overrides, *(["--peak_tflops", str(peak_tflops)] if peak_tflops else [])]
    values = load_arguments([str(folder / "train_args.yaml"), *extra])
    for other in others.values():
        load_arguments([str(other / "train_args.yaml"), *extra])
    if not (values.get("model_name_or_path") or values.get("config_name")):
        raise ValueError("no model: set model_name_or_path or config_name in the recipe or after --")
    facts = RunFacts.from_values(values)
    global_batch = facts.global_batch(gpus)
    slots = build_slots(folder, names, False, False, global_batch=global_batch, gpus=gpus, others=others,
                        tuned=settings)
    known = {"ours", *others, *names, *(v.name for v in variants_of(slots)),
             *(s.setting for s in slots if isinstance(s, Search))}
    if selected - known:
        raise ValueError(f"--only {only}: {sorted(selected - known)} not in this bench: name ours, a --variant, a "
                         f"baseline given with --against, one of its settings or runs ({', '.join(sorted(known))})")
    label = label or folder.name
    return BenchInputs(folder, names, gpus, settings, others, selected, extra, facts.seq_len, global_batch, label,
                       _model_line(label, values))


def _variant_folders(items: list[str]) -> dict[str, Path]:
    """`--variant NAME=FOLDER` values: each a recipe folder (train_args.yaml + ds_config.json) under a new name."""
    others = {}
    for item in items:
        name, _, folder = item.partition("=")
        if not name or not folder or not (Path(folder) / "train_args.yaml").is_file() or \
                not (Path(folder) / "ds_config.json").is_file() or name == "ours" or name in BASELINES:
            raise ValueError(f"--variant {item}: give NAME=FOLDER, a recipe folder (train_args.yaml + ds_config.json) "
                             "and a name that is not ours or a baseline")
        others[name] = Path(folder)
    return others


def _model_line(label: str, values: dict) -> str:
    """The model as the report names it: its parameters and shape."""
    shape = load_config_shape(values.get("model_name_or_path") or values.get("config_name"),
                              overrides=values.get("config_overrides"))
    return (f"{label}: {shape.params:,} parameters ({shape.layers} layers, hidden {shape.hidden}, ffn {shape.ffn}, "
            f"{shape.heads} heads / {shape.kv_heads} kv heads, vocab {shape.vocab})")
