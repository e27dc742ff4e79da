"""Every recipe folder, found on disk: exactly four files, a strict YAML, the generator's ds_config, a README
header with hardware and version, a 3-line launch.sh, and the planner's numbers where the docs quote them."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from hf_zero3 import recipes
from hf_zero3.checkpoint.lifecycle import DEFAULT_SAVE_STEPS, DEFAULT_SAVE_TOTAL_LIMIT
from hf_zero3.config.build import build_ds_config, training_args_overrides
from hf_zero3.config.presets import RECIPE_CONFIGS, render
from hf_zero3.run.launch_command import Target
from tests.conftest import ROOT

RECIPES_DIR = ROOT / "recipes"
RECIPES = sorted(p for p in RECIPES_DIR.iterdir() if p.is_dir())
FILES = {"ds_config.json", "train_args.yaml", "launch.sh", "README.md"}
by_name = pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
PREFERENCE = [p for p in RECIPES if yaml.safe_load((p / "train_args.yaml").read_text()).get("stage", "sft") != "sft"]
"""The recipes of a preference stage (their data are pairs; tests/integration/test_preference.py trains them)."""


def test_recipes_are_found_on_disk_and_nothing_else_lives_under_recipes():
    assert len(RECIPES) == 11
    assert [p.name for p in RECIPES] == sorted(RECIPE_CONFIGS) == ["10b-h200x1", "13b", "20b-h200x2", "70b",
                                                                   "70b-dpo-lora", "70b-lora", "7b", "8b", "8b-dpo",
                                                                   "qwen3-30b-a3b", "tiny"]
    for path in RECIPES_DIR.rglob("*"):  # recursive: a nested folder or stray file is an error too
        rel = path.relative_to(RECIPES_DIR)
        if path.is_dir():
            assert len(rel.parts) == 1, f"nested folder {rel}"
        else:
            assert rel == Path("CHANGELOG.md") or (len(rel.parts) == 2 and rel.name in FILES), f"stray file {rel}"


@by_name
def test_folder_holds_exactly_the_four_files(recipe):
    assert {p.name for p in recipe.iterdir()} == FILES


@by_name
def test_train_args_parse_strictly_and_need_no_string_coercion(recipe):
    from transformers import HfArgumentParser

    from hf_zero3.data.arguments import DataArguments
    from hf_zero3.job.arguments import ModelArguments, TrainingArguments, load_arguments

    raw = yaml.safe_load((recipe / "train_args.yaml").read_text())
    values = load_arguments([str(recipe / "train_args.yaml")])  # unknown keys raise
    # PyYAML reads 2e-5 as a string: every value must already have its field's type (1.0e-5 style floats).
    coerced = [k for k, v in raw.items() if isinstance(v, str) and not isinstance(values[k], str)]
    assert coerced == [], f"{recipe.name}: write these as YAML numbers/booleans: {coerced}"
    assert values["deepspeed"] == str(recipe / "ds_config.json")  # the folder's own config, found next to the YAML
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    _, data, training = parser.parse_dict({**values, "deepspeed": None, "use_cpu": True}, allow_extra_keys=False)
    assert training.output_dir and data.block_size


@by_name
def test_the_commented_chat_run_is_a_valid_data_block(recipe):
    """Each recipe shows a chat run beside its raw-text one: uncommented, its lines are DataArguments fields that
    parse with the right types and name a chat format."""
    from hf_zero3.data.arguments import FORMATS, DataArguments

    if recipe in PREFERENCE:
        pytest.skip(f"{recipe.name} trains on preference pairs: test_preference_recipes_pass_the_stage_checks")
    text = (recipe / "train_args.yaml").read_text()
    block = text[text.index("# Chat data instead"):].splitlines()
    lines = [line[2:] for line in block[1:] if re.match(r"# [a-z_]+: ", line)]
    chat = yaml.safe_load("\n".join(lines))
    assert {"train_file", "data_format", "train_on_inputs", "packing", "overlong"} <= set(chat), recipe.name
    args = DataArguments(**chat)
    assert args.data_format == "chat" and args.data_format in FORMATS and args.packing is True
    assert args.train_on_inputs is False and args.train_file.endswith(".jsonl")
    if recipe.name == "tiny":  # the one that runs as shipped: its chat files are in assets/tiny/chat
        assert (ROOT / args.train_file).is_file() and (ROOT / args.validation_file).is_file()


@pytest.mark.parametrize("recipe", PREFERENCE, ids=lambda p: p.name)
def test_preference_recipes_pass_the_stage_checks(recipe):
    """The stage and its TRL arguments (`stage_args`, strict against TRL's config), as train checks them before start;
    the data file is the user's, so it is left out here."""
    from hf_zero3.job.arguments import load_arguments
    from hf_zero3.run.stages import stage_arg_problems, stage_of

    values = load_arguments([str(recipe / "train_args.yaml")])
    assert stage_of(values).columns is not None and stage_arg_problems(values) == []
    assert values["peft"] and not values.get("ref_model_name_or_path")  # LoRA: the reference is the adapter off


def test_there_are_preference_recipes():
    assert [p.name for p in PREFERENCE] == ["70b-dpo-lora", "8b-dpo"]


@by_name
def test_ds_config_is_the_generators_output(recipe):
    spec = RECIPE_CONFIGS[recipe.name]
    text = (recipe / "ds_config.json").read_text()
    assert json.loads(text) == build_ds_config(spec)
    assert text == render(build_ds_config(spec))


@by_name
def test_train_args_carry_what_the_spec_needs_from_training_arguments(recipe):
    """E.g. activation checkpointing is a TrainingArgument, not a ds_config key: the YAML must set it."""
    values = yaml.safe_load((recipe / "train_args.yaml").read_text())
    needed = training_args_overrides(RECIPE_CONFIGS[recipe.name])
    assert {k: values.get(k) for k in needed} == needed


@by_name
def test_checkpoints_every_500_steps_keep_3(recipe):
    values = yaml.safe_load((recipe / "train_args.yaml").read_text())
    assert values["save_total_limit"] == DEFAULT_SAVE_TOTAL_LIMIT
    if values.get("max_steps", DEFAULT_SAVE_STEPS) >= DEFAULT_SAVE_STEPS:  # the tiny recipe runs 100 steps
        assert values["save_steps"] == DEFAULT_SAVE_STEPS


def _changelog(recipe: Path) -> list[str]:
    """The recipe's `- vN (date): ...` lines in recipes/CHANGELOG.md, oldest first."""
    section = re.search(rf"^## {re.escape(recipe.name)}\n((?:- v\d+ .*\n?)+)", (RECIPES_DIR / "CHANGELOG.md").read_text(),
                        re.MULTILINE)
    return section.group(1).splitlines() if section else []


def _version(recipe: Path) -> int:
    header = (recipe / "README.md").read_text().splitlines()[0]
    match = re.fullmatch(rf"# Recipe `{re.escape(recipe.name)}` \(v(\d+)\) — .+", header)
    assert match, f"{recipe.name}: README must start with '# Recipe `{recipe.name}` (vN) — <what>', got {header!r}"
    return int(match.group(1))


def _header_rows(recipe: Path) -> dict[str, str]:
    """The README's first table: `| row | value |` lines before the first blank line after the title."""
    rows = {}
    for line in (recipe / "README.md").read_text().split("\n\n")[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] and set(cells[0]) != {"-"}:
            rows[cells[0]] = cells[1]
    return rows


@by_name
def test_readme_header_names_hardware_launch_measurement_and_version(recipe):
    version = _version(recipe)
    rows = _header_rows(recipe)
    assert {"target hardware", "launch", "measured"} <= set(rows), rows
    assert f"recipes/{recipe.name}/launch.sh" in rows["launch"]
    assert rows["measured"].startswith(("not yet (no such hardware at hand)", "not yet: ", "20")), rows["measured"]
    first_line = (recipe / "train_args.yaml").read_text().splitlines()[0]
    assert f"(v{version})" in first_line, f"{recipe.name}: train_args.yaml line 1 says {first_line!r}, README v{version}"
    entries = _changelog(recipe)
    assert entries, f"recipes/CHANGELOG.md has no '## {recipe.name}' section with '- vN (date): ...' lines"
    assert max(int(re.match(r"- v(\d+) ", e).group(1)) for e in entries) == version


def test_changelog_lists_only_existing_recipes():
    names = re.findall(r"^## (\S+)$", (RECIPES_DIR / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert sorted(names) == [p.name for p in RECIPES]


def _target(recipe: Path) -> Target:
    """The recipe's target as the registry reads it (`Recipe.target`), as the launcher parses it."""
    target = recipes.get(recipe).target
    assert target, f"{recipe.name}/launch.sh passes no --target"
    return Target.parse(target)


@by_name
def test_launch_sh_is_the_three_line_wrapper(recipe):
    path = recipe / "launch.sh"
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[0] == "#!/usr/bin/env bash"
    assert 'exec python -m hf_zero3 launch --target ' in lines[2] and lines[2].endswith('"$here" "$@"')
    assert path.stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    _target(recipe)


def test_slurm_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/slurm/train.sbatch")], check=False).returncode == 0


PROFILES_OF = {"70b": (("p4d.24xlarge", 1), ("nd-a100-v4", 1), ("a2-highgpu-4g", 2)),
               "70b-lora": (("p4d.24xlarge", 1), ("nd-a100-v4", 1), ("a2-highgpu-4g", 2)),
               "8b-dpo": (("h200x1", 1),), "70b-dpo-lora": (("dgx-a100-80", 1), ("dgx-h100", 1)),
               "20b-h200x2": (("h200x2", 1),), "10b-h200x1": (("h200x1", 1),),
               "qwen3-30b-a3b": (("dgx-h100", 1),)}
"""Recipes sized for named machines (hf_zero3/plan/profiles.py, nodes each): planned there with HEADROOM free, the
first profile being the one their README quotes."""
HEADROOM = 0.1
MEASURED_FIT = {"10b-h200x1": ("2026-12-01_pinned-offload-10b", "2026-12-01_largest-fit-10b-micro4")}
"""Recipes that ship the fastest setting measured on their named machine instead of the planner's choice with HEADROOM
free (10b-h200x1: micro 4 x 2 with pinned host buffers, 10.3 s per step against 44-54 s at the planner's micro 1 x 8
unpinned): planned there without headroom, and their README cites the benchmark reports that measured them."""


def _plans(recipe: Path, hardware=None):
    """(the recipe's own plan at its target, the planner's choice there), or None for targets without GPU memory.
    The target is the recipe's first named profile (with 10% headroom) if it has one, else launch.sh's --target."""
    from hf_zero3.argtypes import parse_size
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.job.facts import RunFacts
    from hf_zero3.plan.choose import choose
    from hf_zero3.plan.memory import plan
    from hf_zero3.plan.profiles import get
    from hf_zero3.plan.shapes import load_shape
    from hf_zero3.plan.types import Hardware, Training
    from hf_zero3.model.lora import planned as planned_adapter

    target = _target(recipe)
    if target.gpu_mem is None:
        return None
    values = yaml.safe_load((recipe / "train_args.yaml").read_text())
    micro, accum = values["per_device_train_batch_size"], values["gradient_accumulation_steps"]
    precision = "bf16" if values.get("bf16") else "fp32"
    shape, seq = load_shape(recipe.name), values["block_size"]
    if hardware is None and recipe.name in PROFILES_OF:
        name, nodes = PROFILES_OF[recipe.name][0]
        hardware = get(name).hardware(nodes, 0.0 if recipe.name in MEASURED_FIT else HEADROOM)
    hardware = hardware or Hardware(target.nodes, target.gpus, parse_size(target.gpu_mem), None)
    spec = ZeroSpec(**{**RECIPE_CONFIGS[recipe.name].model_dump(exclude_unset=True), "precision": precision})
    liger = bool(values.get("use_liger_kernel"))
    adapter = planned_adapter(shape, values.get("peft"))  # a LoRA recipe: its adapter
    preference = RunFacts.from_values(values).preference(lora=adapter is not None)  # a preference recipe: its stage
    ours = plan(shape, hardware, Training(seq, micro, accum, liger=liger, adapter=adapter, preference=preference), spec)
    best = choose(shape, hardware, seq, global_batch=micro * accum * hardware.world_size, precision=precision,
                  liger=liger, adapter=adapter, preference=preference).plan
    return ours, best


@by_name
def test_recipe_fits_its_target_and_the_readme_quotes_the_planner(recipe):
    from hf_zero3.units import gb

    plans = _plans(recipe)
    if plans is None:
        pytest.skip(f"{recipe.name} has no GPU target")
    ours, _ = plans
    assert ours.fits, ours.problems()
    expected = _header_rows(recipe)["expected memory (planner)"]
    assert f"{gb(ours.gpu_bytes)} per GPU" in expected and gb(ours.host_bytes) in expected, expected


@by_name
def test_recipes_that_claim_the_planners_choice_are_it(recipe):
    if "the planner's choice" not in _changelog(recipe)[-1]:
        pytest.skip(f"{recipe.name}'s newest version does not claim to be the planner's choice")
    ours, best = _plans(recipe)
    assert best is not None
    assert (best.label, best.training.micro_batch, best.training.grad_accum) == (
        ours.label, ours.training.micro_batch, ours.training.grad_accum)


@pytest.mark.parametrize("name, profile, nodes", [(r, p, n) for r, ps in PROFILES_OF.items() for p, n in ps
                                                  if r not in MEASURED_FIT])
def test_recipe_is_the_planners_choice_on_each_named_machine_with_headroom(name, profile, nodes):
    """70b and 70b-lora fit p4d.24xlarge, nd-a100-v4 and 2 x a2-highgpu-4g with >= 10% of GPU memory, host RAM and
    NVMe left free, as the planner's least-offload choice; 20b-h200x2 likewise on 2 x H200, 8b-dpo on one H200 and
    70b-dpo-lora on 8 x A100-80GB and 8 x H100-80GB, each planned with its stage's pairs."""
    from hf_zero3.plan.profiles import get

    hardware = get(profile).hardware(nodes, HEADROOM)
    ours, best = _plans(RECIPES_DIR / name, hardware)
    assert ours.fits, ours.problems()
    assert ours.gpu_bytes <= 0.9 * hardware.gpu_mem and ours.host_bytes <= 0.9 * hardware.host_ram
    assert ours.nvme_bytes <= 0.9 * hardware.nvme_free
    assert best is not None and (best.label, best.training.micro_batch, best.training.grad_accum) == (
        ours.label, ours.training.micro_batch, ours.training.grad_accum)


@pytest.mark.parametrize("name", sorted(MEASURED_FIT))
def test_a_recipe_shipping_a_measured_setting_fits_without_headroom_and_cites_its_reports(name):
    """Its own plan fits the machine with nothing to spare (the measurement, not the planner's margins, says it runs);
    with HEADROOM the planner would choose otherwise, and the README says both, linking every report."""
    from hf_zero3.plan.profiles import get

    profile, nodes = PROFILES_OF[name][0]
    ours, best = _plans(RECIPES_DIR / name, get(profile).hardware(nodes, 0.0))
    assert ours.fits, ours.problems()
    careful, chosen = _plans(RECIPES_DIR / name, get(profile).hardware(nodes, HEADROOM))
    assert not careful.fits and chosen is not None  # otherwise the planner's own choice is what to ship
    rows = _header_rows(RECIPES_DIR / name)
    for study in MEASURED_FIT[name]:
        assert (ROOT / "benchmarks" / "results" / study / "report.md").is_file(), study
        assert f"benchmarks/results/{study}/report.md" in rows["measured"], (study, rows["measured"])
    assert f"micro {chosen.training.micro_batch} x accumulation {chosen.training.grad_accum}" in rows["batch"]
    assert "the planner's choice" not in _changelog(RECIPES_DIR / name)[-1]


def test_the_largest_recipes_are_the_largest_the_planner_fits():
    """More layers of the same width do not fit with 10% headroom unless the activations go to host memory (activation
    offload, which these recipes leave off): 20b-h200x2 is the largest of its shape without it. 10b-h200x1 keeps
    SOLAR-10.7B's 48 layers so that its real weights load, and 2 more do not fit either. Its README says so."""
    from hf_zero3.plan.choose import choose
    from hf_zero3.plan.profiles import get
    from hf_zero3.plan.shapes import load_shape, with_changes

    for name, (profile, nodes), expected in (("20b-h200x2", PROFILES_OF["20b-h200x2"][0], [False, False]),
                                             ("10b-h200x1", PROFILES_OF["10b-h200x1"][0], [False, False])):
        values = yaml.safe_load((RECIPES_DIR / name / "train_args.yaml").read_text())
        hardware = get(profile).hardware(nodes, HEADROOM)
        shape = load_shape(name)
        batch = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"] * hardware.world_size
        assert choose(shape, hardware, 4096, global_batch=batch).fits
        more = [choose(with_changes(shape, layers=shape.layers + k), hardware, 4096, global_batch=batch)
                for k in (2, 4)]
        assert [c.fits and not c.plan.spec.activation_offload for c in more] == expected, (name, more)
