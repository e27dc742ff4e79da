"""docs/architecture.md stays true: every module it names exists, and the facts it gives one owner are not worked
out anywhere else (the greps below fail on a second copy)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "hf_zero3"


def sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_and_folder_the_doc_names_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`(hf_zero3/[\w/]+(?:\.py)?)`", text))
    for folder, files in re.findall(r"\| `(hf_zero3/\w+/)` \| ([^|]+) \|", text):
        named |= {folder + name for name in re.findall(r"`(\w+\.py)`", files)}
    assert len(named) >= 25, sorted(named)
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_package_folder_is_in_the_doc():
    text = DOC.read_text()
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert set(folders) >= {"callbacks", "checkpoint", "cli", "config", "ops", "plan", "run"}
    assert all(f"`hf_zero3/{name}/`" in text for name in folders), folders


@pytest.mark.parametrize("pattern, owner, fact", [
    (r"per_device_train_batch_size[^\n]*\*[^\n]*gradient_accumulation_steps|"
     r"gradient_accumulation_steps[^\n]*\*[^\n]*per_device_train_batch_size", "hf_zero3/run/facts.py",
     "the global batch"),
    (r"\"bf16\" if [^\n]*\bbf16\b[^\n]*else \"fp16\"", "hf_zero3/run/facts.py", "the run's precision"),
    (r"\"sdpa\", \"flash_attention_2\", \"eager\"", "hf_zero3/plan/memory.py", "the planned attention kernels"),
    (r"device_count\(\)", "hf_zero3/plan/hardware.py|hf_zero3/ops/doctor.py",
     "the GPU count (the doctor checks each GPU)"),
    (r"virtual_memory\(\)\.total", "hf_zero3/plan/hardware.py", "the host RAM"),
    (r"f\"checkpoint-\{", "hf_zero3/checkpoint/lifecycle.py|hf_zero3/callbacks/nonfinite_guard.py|"
                         "hf_zero3/callbacks/checkpoint_guard.py", "a checkpoint's folder"),
    (r"def _?positive_int|def _?parse_size|def _port", "hf_zero3/argtypes.py", "argument types"),
    (r"glob\(\"\*/train_args\.yaml\"\)|Path\(\"recipes\"\)", "hf_zero3/recipes.py", "the recipe registry"),
])
def test_a_fact_is_worked_out_by_its_owner_only(pattern, owner, fact):
    owners = set(owner.split("|"))
    elsewhere = [path for path, text in sources().items() if path not in owners and re.search(pattern, text)]
    assert not elsewhere, f"{fact} is worked out outside {owner}: {elsewhere} (ask the owner instead)"


def test_the_memory_model_is_pure_arithmetic():
    text = (PACKAGE / "plan" / "memory.py").read_text()
    imports = set(re.findall(r"^\s*(?:import|from) ([\w.]+)", text, re.M))
    assert not imports & {"torch", "psutil", "os", "shutil", "subprocess"}, imports
