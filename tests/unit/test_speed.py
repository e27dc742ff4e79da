"""The planner's speed choice: measured figures decide between ZeRO-2 and ZeRO-3, each at its largest fitting micro
batch, and checkpointing is on only when needed or measured faster; the table quotes its benchmark files exactly."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

import pytest

from hf_zero3.cli.main import main
from hf_zero3.plan.choose import choose
from hf_zero3.plan.shapes import load_shape
from hf_zero3.plan.speed import MEASURED, Measurement, faster_measured
from hf_zero3.plan.types import Hardware
from tests.conftest import ROOT, error_naming, plan_line

S8 = load_shape("8b")
H200X2 = Hardware(1, 2, 140 * 2**30, None)

STOCK = "transformers"
"""The loss of transformers' Trainer (the whole logits, or Liger's): what the measured runs and the by-hand
figures below ran, before hf-zero3 train ran TRL's fused LM head."""


def _report_medians(path: str) -> dict[str, tuple[int, int]]:
    """config -> (median tokens/s/GPU, runs) from a bench report's first table."""
    out = {}
    for name, tps, runs in re.findall(r"^\| (\w+) \| (\d+) \| [^\n]*\| (\d+): \d+-\d+ \|$", (ROOT / path).read_text(),
                                      re.MULTILINE):
        out.setdefault(name, (int(tps), int(runs)))
    return out


def test_every_measured_figure_is_the_median_in_its_report():
    """One owner per figure: the table copies the report; a figure not in its file, or a changed report, fails."""
    for m in MEASURED:
        name = m.config.split(":")[0]
        assert (ROOT / m.source).is_file(), m.source
        tps, runs = _report_medians(m.source)[name]
        assert m.tokens_per_s == tps, (m.config, tps)
        assert (f"{runs} runs" if runs > 1 else "one run") in m.config, (m.config, runs)


def test_8b_on_2xh200_with_liger_picks_recipe_8b_v2_by_measured_speed():
    """Memory alone put ZeRO-2 micro 1 first (no per-layer gathers); measured, ZeRO-3 + Liger micro 3 is 1.22x it."""
    choice = choose(S8, H200X2, 4096, global_batch=12, liger=True)
    p = choice.plan
    assert (p.label, p.training.micro_batch, p.training.grad_accum) == ("ZeRO-3", 3, 2)
    assert not p.spec.activation_checkpointing and not p.tight
    assert choice.training_args["use_liger_kernel"] is True
    assert choice.speed.startswith("ZeRO-3 by measured speed")
    error_naming(choice.speed, "ZeRO-3 + Liger micro 3: 10,121", "ZeRO-2 micro 1: 8,323",
                 "ZeRO-2 + Liger micro 1: not measured", "lower bound")
    assert choice.speed.endswith("(study 8b-tuned)")  # the study that holds both rows
    # without a global batch: the same micro batch (the largest that fits), accumulation 1
    alone = choose(S8, H200X2, 4096, liger=True).plan
    assert (alone.label, alone.training.micro_batch, alone.training.grad_accum) == ("ZeRO-3", 3, 1)


def test_without_a_lower_bound_for_both_stages_the_memory_order_stands_and_says_so():
    """Without Liger ZeRO-3 fits micro 1 only with room (micro 2 is tight); no ZeRO-3 row has micro <= 1 and no Liger,
    so no measurement can speak for it: ZeRO-2 first, as memory orders it."""
    choice = choose(S8, H200X2, 4096, global_batch=12, trainer=STOCK)
    assert (choice.plan.label, choice.plan.training.micro_batch) == ("ZeRO-2", 1)
    assert "use_liger_kernel" not in choice.training_args
    assert "no measurement of both" in choice.speed and "memory-only order: ZeRO-2 first" in choice.speed
    # other hardware: the 140 GiB rows do not apply to 80 GiB GPUs
    other = choose(S8, Hardware(1, 8, 80 * 2**30, None), 4096, global_batch=64, liger=True, trainer=STOCK)
    assert other.plan.spec.stage == 2 and "no measurement of both" in other.speed


def test_a_measured_faster_zero2_wins_and_a_faster_row_from_another_machine_is_ignored():
    """Rows are compared only within one source file; the closest-matching file decides."""
    z3 = next(m for m in MEASURED if m.stage == 3 and m.liger)
    fast_z2 = Measurement(z3.params, 4096, 2, 140.0, 2, True, False, 1, 11_000, "machine-b.md", "z2: one run")
    slow_z3 = dataclasses.replace(z3, tokens_per_s=9_000, source="machine-b.md")
    choice = choose(S8, H200X2, 4096, global_batch=12, liger=True, speed_table=(*MEASURED, fast_z2, slow_z3))
    assert choice.plan.label == "ZeRO-2" and choice.plan.training.micro_batch == 1
    assert choice.speed.startswith("ZeRO-2 by measured speed")
    error_naming(choice.speed, "ZeRO-2 + Liger micro 1: 11,000", "(study machine-b)")
    lone = Measurement(z3.params, 4096, 2, 140.0, 2, True, False, 1, 99_000, "machine-c.md", "z2 alone")
    assert choose(S8, H200X2, 4096, global_batch=12, liger=True, speed_table=(*MEASURED, lone)).plan.spec.stage == 3


def test_checkpointing_only_when_nothing_fits_without_it():
    small = Hardware(1, 2, 100 * 2**30, None)  # 8B without Liger on 2 x 100 GiB: nothing fits without recomputation
    choice = choose(S8, small, 4096, global_batch=12, trainer=STOCK)
    assert choice.plan.label == "ZeRO-3 + checkpointing" and choice.plan.training.micro_batch == 3
    assert choice.speed.startswith("ZeRO-3 + checkpointing ")
    error_naming(choice.speed, "fastest option that fits", "nothing without checkpointing")
    assert all(p.spec.activation_checkpointing or not p.fits for p in choice.tried
               if p.spec.offload_optimizer.device == "none")
    assert choice.training_args["gradient_checkpointing"] is True
    roomy = choose(S8, H200X2, 4096, global_batch=12, liger=True, trainer=STOCK)
    assert not roomy.plan.spec.activation_checkpointing and "gradient_checkpointing" not in roomy.training_args


@pytest.mark.parametrize("flag,liger", [("--liger", True), ("--no-liger", False)])
def test_plan_cli_says_why_it_chose(capsys, flag, liger):
    argv = ["plan", "--model", "8b", "--gpus", "2", "--gpu-mem", "140GiB", "--global-batch", "12", flag,
            "--trainer", STOCK]  # the measured rows ran transformers' Trainer
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert plan_line(text, "liger").startswith(f"{'on' if liger else 'off'} ({flag})")
    speed = plan_line(text, "speed")
    assert ("(study 8b-tuned)" in speed) if liger else ("memory-only order" in speed)
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["liger"] is liger and out["speed"] == speed
    assert out["choice"]["option"] == ("ZeRO-3" if liger else "ZeRO-2")


def test_plan_cli_uses_liger_when_installed(capsys, monkeypatch):
    from hf_zero3.plan import hardware

    argv = ["plan", "--model", "8b", "--gpus", "2", "--gpu-mem", "140GiB", "--global-batch", "12", "--json"]
    for installed in ({"liger-kernel": "0.8.5"}, {}):
        monkeypatch.setattr(hardware, "versions", lambda installed=installed: {"python": "3", **installed})
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["liger"] is bool(installed)
        assert out["liger_why"].startswith("on (liger-kernel 0.8.5 installed here" if installed else
                                           "off (liger-kernel not installed here")


S7 = load_shape("7b")
H200 = Hardware(1, 1, 141 * 2**30, 125 * 2**30)
H200X1 = Hardware(1, 1, 140 * 2**30, 125 * 2**30)  # the h200x1 profile
PARTIAL = "benchmarks/results/2026-12-01_partial-ckpt-7b-1gpu/report.md"


def test_one_h200_7b_checkpoints_the_first_8_layers_at_micro_2_because_each_step_measured_faster():
    """Two measured steps, each within one lease. Without checkpointing a 7B fits one H200 only at micro 1; with it,
    micro 8 ran 1.07x that (ZeRO-3's per-micro-step cost paid twice instead of 16 times). Checkpointing only the
    first 8 layers at micro 2 (the fewest that fit the h200x1 profile's 140 GiB) then ran 1.15x micro 8 with all of
    them (less recompute)."""
    choice = choose(S7, H200X1, 4096, global_batch=16, load_bytes=4, liger=True, trainer=STOCK)
    p = choice.plan
    assert (p.label, p.training.micro_batch, p.training.grad_accum) == (
        "ZeRO-3 + checkpointing (first 8 layers)", 2, 8)
    assert choice.speed.startswith("ZeRO-3 + Liger + checkpointing (first 8 layers) micro 2 ")
    error_naming(choice.speed, "11,680 vs 10,190", "checkpointing micro 8", "(study partial-ckpt-7b-1gpu)")
    assert choice.training_args["gradient_checkpointing"] is True
    assert choice.training_args["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert choice.training_args["gradient_checkpointing_layers"] == 8
    assert choice.ds_config["train_micro_batch_size_per_gpu"] == 2
    without_partial = tuple(m for m in MEASURED if m.source != PARTIAL)
    alone = choose(S7, H200X1, 4096, global_batch=16, load_bytes=4, liger=True, speed_table=without_partial,
                   trainer=STOCK)
    assert (alone.plan.label, alone.plan.training.micro_batch) == ("ZeRO-3 + checkpointing", 8)
    assert alone.speed.startswith("ZeRO-3 + Liger + checkpointing micro 8 ")
    error_naming(alone.speed, "by measured speed", "10,089 vs 9,410")


def test_fewer_checkpointed_layers_than_measured_count_the_row_with_more_as_a_lower_bound():
    """141 GiB fits 7 checkpointed layers at micro 2; the row with 8 (more recompute) bounds it from below, and it
    beats micro 8 with all layers: chosen, and the reason says "at least"."""
    choice = choose(S7, H200, 4096, global_batch=16, load_bytes=4, liger=True, trainer=STOCK)
    assert (choice.plan.spec.checkpointed_layers, choice.plan.training.micro_batch) == (7, 2)
    error_naming(choice.speed, "at least 11,680", "8 layers", "vs 10,190")
    slow = tuple(dataclasses.replace(m, tokens_per_s=9_000) if m.source == PARTIAL and m.checkpointed_layers else m
                 for m in MEASURED)  # a bound below the full-checkpointing row decides nothing
    kept = choose(S7, H200, 4096, global_batch=16, load_bytes=4, liger=True, speed_table=slow, trainer=STOCK)
    assert (kept.plan.spec.checkpointed_layers, kept.plan.training.micro_batch) == (None, 8)


def test_partial_checkpointing_is_only_planned_where_checkpointing_is_needed():
    """At micro 1 the 7B fits one H200 without checkpointing: no partial plan there; where it is, the fewest layers
    that fit, and one fewer does not."""
    tried = choose(S7, H200, 4096, global_batch=16, liger=True, trainer=STOCK).tried
    partial = {p.training.micro_batch: p for p in tried if p.spec.checkpointed_layers and p.spec.stage == 3
               and "offload" not in p.label}
    assert 1 not in partial and partial[2].spec.checkpointed_layers == 7 and partial[2].fits
    from hf_zero3.plan.memory import plan

    one_fewer = partial[2].spec.model_copy(update={"checkpointed_layers": 6})
    assert not plan(S7, H200, partial[2].training, one_fewer).fits


def test_checkpointing_needs_both_measured_exactly_in_one_file():
    """A row for micro 4 does not speak for micro 8 (checkpointing's gain is the larger micro batch), and rows from
    two files are never compared; then the memory order stands: no checkpointing."""
    def checkpoints(table) -> bool:
        return choose(S7, H200, 4096, global_batch=16, liger=True, speed_table=table).plan.spec.activation_checkpointing

    # ck4 too: with all layers checkpointed it bounds micro 4 with fewer from below, in lean's file
    without = tuple(m for m in MEASURED if not m.config.startswith(("ck8", "ck4")))
    ck8 = next(m for m in MEASURED if m.config.startswith("ck8"))
    assert checkpoints(MEASURED) and not checkpoints(without)
    assert not checkpoints((*without, dataclasses.replace(ck8, source="machine-b.md")))


def test_a_faster_measurement_without_checkpointing_keeps_it_off_and_says_why():
    lean = next(m for m in MEASURED if m.config.startswith("lean"))
    quicker = (*(m for m in MEASURED if m is not lean), dataclasses.replace(lean, tokens_per_s=12_000))
    choice = choose(S7, H200, 4096, global_batch=16, liger=True, speed_table=quicker)
    assert not choice.plan.spec.activation_checkpointing and choice.plan.training.micro_batch == 1
    assert choice.speed.startswith("ZeRO-3 + Liger micro 1 ")
    error_naming(choice.speed, "by measured speed", "12,000 vs 10,089", "checkpointing micro 8")
    tried = {(p.spec.activation_checkpointing, p.training.micro_batch): p for p in choice.tried
             if p.fits and p.label.startswith("ZeRO-3") and "offload" not in p.label}
    assert faster_measured(tried[(False, 1)], tried[(True, 2)], S7, H200, 4096) is None  # micro 2: not measured


def test_the_7b_readme_runs_what_the_planner_chooses_for_one_h200(capsys):
    """recipes/7b/README.md's one-GPU command carries the planner's TrainingArguments; a planner change that moves
    them fails here until the README follows."""
    assert main(["plan", "--model", "7b", "--hardware", "h200x1", "--global-batch", "16", "--liger", "--json",
                 "--trainer", STOCK]) == 0  # measured on transformers' Trainer (Liger's fused cross-entropy)
    args = json.loads(capsys.readouterr().out)["training_args"]
    readme = (ROOT / "recipes/7b/README.md").read_text()
    block = readme[readme.index("hf-zero3 plan --model 7b --hardware h200x1"):].split("```")[0]
    words = shlex.split(block.replace("\\\n", " ").splitlines()[1])  # the launch line after the plan line
    given = {w[2:]: words[i + 1] for i, w in enumerate(words) if w.startswith("--")}
    assert args.pop("bf16") is True and "\nbf16: true\n" in (ROOT / "recipes/7b/train_args.yaml").read_text()
    for key, value in args.items():
        assert given.get(key) == (json.dumps(value) if isinstance(value, dict) else str(value).lower()), key


def test_after_an_oom_with_partial_checkpointing_the_next_step_checkpoints_every_layer():
    from hf_zero3.plan.advice import oom_advice

    best = choose(S7, H200X1, 4096, global_batch=16, load_bytes=4, liger=True, trainer=STOCK).plan
    advice = oom_advice(S7, H200X1, best.training, best.spec)
    assert "(ZeRO-3 + checkpointing (first 8 layers), micro batch 2)" in advice
    assert advice.endswith("--gradient_checkpointing_layers null")
    error_naming(advice.splitlines()[-1], "ZeRO-3 + checkpointing, micro batch 2", "--gradient_checkpointing_layers")


def test_plan_cli_says_how_to_get_partial_checkpointing_in_a_plain_trainer_script(capsys):
    assert main(["plan", "--model", "7b", "--hardware", "h200x1", "--global-batch", "16", "--liger",
                 "--trainer", STOCK]) == 0  # a plain Trainer script: transformers' loss
    out = capsys.readouterr().out
    assert "--gradient_checkpointing_layers 8 " in out
    assert "trainer.add_callback(hf_zero3.callbacks.PartialCheckpointingCallback(8))" in out


def test_a_measured_partial_plan_can_replace_a_choice_without_checkpointing():
    """8B on 2 x H200, global batch 12: recipe 8b v2 runs micro 3 without checkpointing; micro 6 fits with the first
    14 layers checkpointed. A row saying that runs faster (same file as the v2 row) makes it the choice; without
    one, nothing changes."""
    v2 = next(m for m in MEASURED if m.config.startswith("ours: recipe 8b v2"))
    assert choose(S8, H200X2, 4096, global_batch=12, liger=True, trainer=STOCK).plan.spec.activation_checkpointing is False
    faster = Measurement(v2.params, 4096, 2, 140.0, 3, True, True, 6, 10_500, v2.source, "p6_14: test row", 14)
    choice = choose(S8, H200X2, 4096, global_batch=12, liger=True, speed_table=(*MEASURED, faster), trainer=STOCK)
    assert (choice.plan.spec.checkpointed_layers, choice.plan.training.micro_batch) == (14, 6)
    assert choice.speed.startswith("ZeRO-3 + Liger + checkpointing (first 14 layers) micro 6 ")
    error_naming(choice.speed, "by measured speed", "10,500 vs 10,121")
