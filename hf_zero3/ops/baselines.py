"""The baselines `hf-zero3 bench` runs against: the stock setups as documented, and what a competent user runs with
every switch the Trainer offers without code.

The documented ones (`stock`, `stock_offload`, `fsdp2`) are transformers' templates as written. The tuned ones
(`stock_tuned`, `zero2_tuned`, `fsdp2_tuned`, `plain_tuned`; `tuned` names all that apply) are each one engine
(the stock ZeRO-3 or ZeRO-2 template, FSDP2 through the Trainer's `fsdp`/`fsdp_config`, or the plain Trainer without
DeepSpeed: DDP on several GPUs) with `use_liger_kernel`, the Trainer's fused AdamW (`optim adamw_torch_fused`, no
DeepSpeed optimizer or scheduler) and, by default, two settings: activation checkpointing on and off. Each setting
runs at the best micro batch that fits: its search starts at a micro batch (the per-rank batch unless given) and,
on an out-of-memory failure, tries the next smaller divisor of the per-rank batch; the accumulation keeps the
recipe's global batch. Every attempt is a real run and stays in the report, the failed ones with their error.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from hf_zero3.config import batch

STOCK_ZERO3 = {
    # transformers' documented ZeRO-3 template ("auto" everywhere the Trainer fills), DeepSpeed's AdamW and
    # WarmupLR, no offload; `stock_offload` is the same template with its CPU offload of params and optimizer.
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
STOCK_ZERO2 = {
    # transformers' documented ZeRO-2 template without its CPU offload, optimizer and scheduler blocks.
    "fp16": STOCK_ZERO3["fp16"], "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
FSDP2_CONFIG = {"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "activation_checkpointing": True}
"""The Trainer's `fsdp_config` for FSDP2 (accelerate's `fsdp_version: 2`, fully_shard per decoder layer)."""

TUNED = ("stock_tuned", "zero2_tuned", "fsdp2_tuned", "plain_tuned")
"""The competent user's engines: stock ZeRO-3, stock ZeRO-2, FSDP2, the plain Trainer (no DeepSpeed; DDP on several
GPUs)."""
TUNED_SET = "tuned"
"""In `--against`: every tuned baseline; `plain_tuned` only on one GPU (on several it is DDP, which holds the whole
model's states on every GPU: name it to run it)."""
BASELINES = ("stock", "stock_offload", "fsdp2", *TUNED)


def expand_against(names: list[str], gpus: int) -> list[str]:
    """`--against` with `tuned` replaced by the tuned baselines that apply to `gpus` ranks, each name once, in order."""
    out: list[str] = []
    for name in names:
        for one in ([t for t in TUNED if t != "plain_tuned" or gpus == 1] if name == TUNED_SET else [name]):
            if one not in out:
                out.append(one)
    return out


@dataclass
class Variant:
    """One benchmarked configuration: a name, the launcher, and the train overrides that define it."""

    name: str
    launcher: str  # "deepspeed" or "torchrun"
    overrides: list[str] = field(default_factory=list)
    ds_config: dict | None = None
    recipe_dir: Path | None = None
    """Whose train_args.yaml it starts from: the benchmarked recipe's unless set (`--variant NAME=DIR`)."""
    baseline: str = ""
    """The baseline it is one run of: a tuned baseline's name for every micro batch its search tries."""
    setting: str = ""
    """A tuned baseline's setting (`stock_tuned_ckpt`, `stock_tuned_nockpt`): the micro batches of one search."""
    micro: int = 0
    """A tuned baseline's micro batch (0 for the other variants)."""


@dataclass(frozen=True)
class Tuned:
    """One setting of a tuned baseline: checkpointing on or off, and the micro batch its search starts from (None: the
    per-rank batch, the largest there is). Without `--tuned` a baseline runs both settings from the per-rank batch;
    `--tuned NAME=MICRO[+ckpt]` gives its settings (repeatable: `--tuned stock_tuned=2 --tuned stock_tuned=8+ckpt`),
    which saves the runs that would run out of memory where the fit is known."""

    start: int | None = None
    checkpointing: bool = False

    @classmethod
    def parse(cls, text: str) -> tuple[str, Tuned]:
        name, _, rest = text.partition("=")
        micro, plus, flag = rest.partition("+")
        if name not in TUNED or not micro.isdigit() or int(micro) < 1 or (plus and flag != "ckpt"):
            raise ValueError(f"--tuned {text}: give NAME=MICRO or NAME=MICRO+ckpt with NAME one of "
                             f"{', '.join(TUNED)}, e.g. stock_tuned=8+ckpt (the search starts at MICRO and goes down "
                             "on out-of-memory)")
        return name, cls(int(micro), bool(plus))

    @staticmethod
    def collect(items: list[str]) -> dict[str, list[Tuned]]:
        """`--tuned` values by baseline, in the order given; a setting given twice runs once."""
        tuned: dict[str, list[Tuned]] = {}
        for item in items:
            name, setting = Tuned.parse(item)
            if setting not in tuned.setdefault(name, []):
                tuned[name].append(setting)
        return tuned

    def label(self, baseline: str) -> str:
        return f"{baseline}_{'ckpt' if self.checkpointing else 'nockpt'}"


DEFAULT_SETTINGS = (Tuned(None, False), Tuned(None, True))


@dataclass
class Search:
    """A tuned baseline's setting: its variants from the starting micro batch down, one per divisor of the per-rank
    batch. The first that does not run out of memory is the setting's; a failure of another kind ends the search."""

    baseline: str
    setting: str
    candidates: list[Variant]


def per_rank_batch(global_batch: int, gpus: int) -> int:
    """Sequences per rank per optimizer step; ValueError naming the fix when the ranks do not divide the batch."""
    count = batch.per_rank(global_batch, gpus)
    if count is None:
        raise ValueError(f"the global batch {global_batch} is not a multiple of the {gpus} ranks: the tuned baselines "
                         "train the recipe's global batch, so pick --per_device_train_batch_size/"
                         "--gradient_accumulation_steps so that it is")
    return count


def micro_candidates(start: int | None, per_rank: int) -> list[int]:
    """The micro batches a search tries, largest first: the divisors of the per-rank batch up to `start`."""
    top = per_rank if start is None else min(start, per_rank)
    return [m for m in range(top, 0, -1) if batch.accumulation(per_rank, m, 1) is not None]


def tuned_variant(name: str, setting: Tuned, micro: int, per_rank: int) -> Variant:
    """The run of a tuned baseline's setting at one micro batch: the engine, Liger, fused AdamW, checkpointing on or
    off, accumulation per_rank / micro."""
    ckpt = setting.checkpointing and name != "fsdp2_tuned"  # FSDP2 recomputes through its own config, not twice
    accum = batch.accumulation(per_rank, micro, 1)
    overrides = ["--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accum),
                 "--gradient_checkpointing", "true" if ckpt else "false", "--use_liger_kernel", "true",
                 "--optim", "adamw_torch_fused"]
    if ckpt:
        overrides += ["--gradient_checkpointing_kwargs", '{"use_reentrant": false}']
    label = f"{name}_{micro}{'_ckpt' if setting.checkpointing else ''}"
    common = {"baseline": name, "setting": setting.label(name), "micro": micro}
    if name == "fsdp2_tuned":
        fsdp = {**FSDP2_CONFIG, "activation_checkpointing": setting.checkpointing}
        return Variant(label, "torchrun", ["--deepspeed", "null", "--fsdp", "full_shard auto_wrap",
                                           "--fsdp_config", json.dumps(fsdp), *overrides], **common)
    if name == "plain_tuned":
        return Variant(label, "torchrun", ["--deepspeed", "null", *overrides], **common)
    config = copy.deepcopy(STOCK_ZERO2 if name == "zero2_tuned" else STOCK_ZERO3)
    config.pop("optimizer", None)  # the Trainer's own optimizer and scheduler
    config.pop("scheduler", None)
    return Variant(label, "deepspeed", overrides, ds_config=config, **common)


def documented_variant(name: str, on_gpu: bool) -> Variant:
    """`stock`, `stock_offload` or `fsdp2` as documented: checkpointing on, the recipe's micro batch, no Liger."""
    if name == "fsdp2":
        return Variant(name, "torchrun", ["--deepspeed", "null", "--fsdp", "full_shard auto_wrap", "--fsdp_config",
                                          json.dumps(FSDP2_CONFIG), "--use_liger_kernel", "false"], baseline=name)
    config = copy.deepcopy(STOCK_ZERO3)
    if name == "stock_offload":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if not on_gpu:  # DeepSpeed's fused GPU Adam does not exist on CPU; torch's Adam is what runs there
        config["optimizer"]["params"]["torch_adam"] = True
    return Variant(name, "deepspeed", ["--gradient_checkpointing", "true", "--use_liger_kernel", "false",
                                       "--gradient_checkpointing_kwargs", '{"use_reentrant": false}'],
                   ds_config=config, baseline=name)


def build_slots(recipe_dir: Path, against: list[str], breakdown: bool, on_gpu: bool, *, global_batch: int = 0,
                gpus: int = 2, others: dict[str, Path] | None = None,
                tuned: dict[str, list[Tuned]] | None = None) -> list[Variant | Search]:
    """`ours` (the recipe as it is), other recipe folders run the same way, then the baselines (`against`, with
    `tuned` expanded): a Variant each, or a Search per setting of a tuned baseline."""
    ours_config = json.loads((recipe_dir / "ds_config.json").read_text())
    slots: list[Variant | Search] = [Variant("ours", "deepspeed", ds_config=ours_config)]
    for name, folder in (others or {}).items():
        slots.append(Variant(name, "deepspeed", ds_config=json.loads((folder / "ds_config.json").read_text()),
                             recipe_dir=folder))
    names = expand_against(against, gpus)
    for name in names:
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}: choose from {', '.join((TUNED_SET, *BASELINES))}")
    per_rank = per_rank_batch(global_batch, gpus) if any(n in TUNED for n in names) else 0
    for name in names:
        if name not in TUNED:
            slots.append(documented_variant(name, on_gpu))
            continue
        for setting in (tuned or {}).get(name) or DEFAULT_SETTINGS:
            slots.append(Search(name, setting.label(name), [tuned_variant(name, setting, m, per_rank)
                                                            for m in micro_candidates(setting.start, per_rank)]))
    if breakdown:
        for variant in variants_of(slots):
            if variant.ds_config is not None:
                variant.ds_config["wall_clock_breakdown"] = True
    return slots


def variants_of(slots: list[Variant | Search]) -> list[Variant]:
    """Every variant the slots may run, in order (a search's every candidate)."""
    return [v for s in slots for v in (s.candidates if isinstance(s, Search) else [s])]


def selected(slot: Variant | Search, only: frozenset[str]) -> bool:
    """Whether `--only` names this slot: by its name, its baseline, its setting, or (a search) one of its runs."""
    if not only:
        return True
    if isinstance(slot, Search):
        return bool({slot.baseline, slot.setting, *(v.name for v in slot.candidates)} & only)
    return bool({slot.name, slot.baseline} - {""} & only)


def search_state(search: Search, first_runs: dict[str, dict]) -> tuple[str, Variant | None]:
    """Where a search stands, from the summaries of its candidates' first runs (name -> summary; those not run are
    absent): ("found", the variant that fits), ("next", the variant to run now), ("failed", None: a failure other than
    out-of-memory, or every micro batch ran out of memory)."""
    for variant in search.candidates:
        summary = first_runs.get(variant.name)
        if summary is None:
            return "next", variant
        if "error" not in summary:
            return "found", variant
        if not summary.get("out_of_memory"):
            return "failed", None
    return "failed", None
