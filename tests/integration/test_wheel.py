"""The wheel carries the recipes: `hf-zero3` installed from it finds them from any directory, as from a checkout.

Built with pip from a copy of the sources (no network: the build backend is the installed setuptools), installed
into a fresh venv that sees this venv's dependencies but not its editable hf_zero3, run from an empty directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT, explain, subprocess_env

pytestmark = pytest.mark.integration

SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "train.py", "hf_zero3", "recipes",
           "assets/tiny/model")
PLAN = ["plan", "--model", "70b", "--gpus", "8", "--gpu-mem", "40GB"]


def _run(cmd: list, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}  # the wheel's hf_zero3, not a checkout's
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, explain(proc)
    return proc


def test_an_installed_wheel_finds_the_recipes_from_another_directory(tmp_path):
    source = tmp_path / "source"
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info beside the sources
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
          tmp_path / "dist", source], tmp_path)
    wheel = next((tmp_path / "dist").glob("hf_zero3-*.whl"))

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], tmp_path)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path)
                .stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # not a site dir: no editable finder

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([python, "-c", "import hf_zero3.recipes as r; print(r.ROOT); print(len(r.names()))"], elsewhere)
    root, count = where.stdout.split()
    assert Path(root) == site / "hf_zero3" / "_shipped" and int(count) == len(list((ROOT / "recipes").glob("*/")))
    installed = _run([venv / "bin" / "hf-zero3", *PLAN], elsewhere)
    checkout = _run([sys.executable, "-m", "hf_zero3", *PLAN], ROOT)
    assert installed.stdout == checkout.stdout and "model     70b: 68.98B params" in installed.stdout
    tiny = _run([venv / "bin" / "hf-zero3", "plan", "--model", "tiny", "--gpus", "2", "--gpu-mem", "40GB"], elsewhere)
    assert "model     tiny: 0.00B params (L4 H128" in tiny.stdout  # the recipe's config, shipped beside it
