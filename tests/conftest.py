"""Shared test helpers: real subprocess runs with free ports, and HF global-state hygiene."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "recipes" / "tiny" / "train_args.yaml"


def subprocess_env(**extra: str) -> dict[str, str]:
    """This interpreter's bin first on PATH (deepspeed, torchrun), no inherited rank variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(cmd: list[str], timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """Run a command from the repository root; output is kept for assertions and shown on failure."""
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=subprocess_env(**env), capture_output=True,
                          text=True, timeout=timeout)


VENV = Path(sys.executable).parent.parent
"""The venv running the tests; `make` targets get it as VENV so they set nothing up."""


def make(target: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`make <target> [VAR=value ...]` with this interpreter's venv, setup taken as done (`-o`: nothing is installed)."""
    return run(["make", "--no-print-directory", "-o", f"{VENV}/bin/.installed", f"VENV={VENV}", target, *args], **env)


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-4000:]}"


def train_log(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "train_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in train_log(output_dir) if "loss" in r]


@pytest.fixture
def single_rank_env(monkeypatch):
    """Rank variables present, so an in-process `hf_zero3.train.main` leaves the process environment alone."""
    from hf_zero3.distributed import free_port

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(autouse=True)
def _reset_hf_deepspeed_state():
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


@pytest.fixture
def unreadable(tmp_path):
    """`unreadable(name)`: a path under tmp_path that exists but cannot be opened for reading.

    chmod 000 does not stop root, so as root the path links to a write-only sysfs file, which the kernel refuses
    to open for reading to anyone.
    """
    def make(name: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            path.write_text("{}\n")
            path.chmod(0)
            return path
        for candidate in ("/sys/bus/pci/rescan", "/sys/bus/pci/drivers_probe", "/sys/class/zram-control/hot_remove"):
            try:
                open(candidate, "rb").close()
            except PermissionError:
                path.symlink_to(candidate)
                return path
            except OSError:
                continue
        pytest.skip("running as root with no write-only file to stand in for an unreadable one")

    return make
