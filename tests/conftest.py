"""Shared test helpers: real subprocess runs with free ports, and HF global-state hygiene."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file

from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.job.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "recipes" / "tiny" / "train_args.yaml"
CHECKPOINT_RUN = ["--max_steps", "8", "--save_steps", "2", "--logging_steps", "1", "--validation_file", "null",
                  "--warmup_steps", "2"]
"""The tiny recipe as the checkpoint tests run it: 8 steps, a save every 2 (every such run logs the same losses)."""


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


def error_naming(err: str, field: str, *fix: str) -> str:
    """The error line that names `field` and every phrase of `fix` (case-insensitive): what a user needs from a
    message, not its whole sentence. Fails showing the output when no line does."""
    lines = [line for line in err.splitlines() if field.lower() in line.lower()]
    hits = [line for line in lines if all(f.lower() in line.lower() for f in fix)]
    assert hits, f"no line names {field!r} with the fix {fix}:\n{err}"
    return hits[0]


def plan_lines(out: str, label: str) -> list[str]:
    """The text of every `label` line the planner prints (`hf-zero3 plan`, the launcher's dry run: a label, then the
    text in an aligned column), found by its label rather than by the column's width."""
    import re

    return [m.group(1) for m in re.finditer(rf"^{re.escape(label)} +(\S.*)$", out, re.M)]


def plan_line(out: str, label: str) -> str:
    """The text of the one `label` line (see `plan_lines`)."""
    lines = plan_lines(out, label)
    assert len(lines) == 1, f"expected one {label!r} line, got {lines}\n{out}"
    return lines[0]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-4000:]}"


def train_log(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "train_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in train_log(output_dir) if "loss" in r]


class Launch:
    """recipes/tiny/launch.sh in its own session, output to a file, so a test can watch, kill and wait."""

    def __init__(self, out: Path, *extra, log: Path, **env):
        self.out, self.log = Path(out), Path(log)
        with self.log.open("w") as f:
            self.proc = subprocess.Popen([str(c) for c in [ROOT / "recipes/tiny/launch.sh", "--output_dir", out,
                                                           *extra]],
                                         cwd=ROOT, env=subprocess_env(MASTER_PORT=str(free_port()), **env),
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def rank_pid(self, rank: int, timeout: float = 300) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    cmdline = child.cmdline()
                    if f"--local_rank={rank}" in cmdline and ("hf_zero3.train" in cmdline or "train.py" in cmdline):
                        return child.pid
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"rank {rank} never started\n{self.text()}")

    def wait_for(self, condition, timeout: float = 300, poll: float = 0.2) -> None:
        deadline = time.time() + timeout
        while not condition():
            assert self.proc.poll() is None, f"run ended before the condition held\n{self.text()}"
            assert time.time() < deadline, f"timed out\n{self.text()}"
            time.sleep(poll)

    def kill_rank(self, rank: int) -> None:
        os.kill(self.rank_pid(rank), signal.SIGKILL)

    def wait(self, timeout: float = 300) -> int:
        """The exit status; a run that outlives `timeout`, or leaves a rank behind, is a hang: kill and fail."""
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"hung: no exit {timeout} s after the failure\n{self.text()}") from None
        time.sleep(1)
        left = [p for p in psutil.process_iter(["pid", "cmdline"])
                if str(self.out) in " ".join(p.info["cmdline"] or [])]
        for process in left:
            process.kill()
        assert not left, f"ranks left running after the launcher exited: {[p.info['pid'] for p in left]}"
        return status

    def text(self) -> str:
        return self.log.read_text()[-6000:]


def logged_steps(out: Path) -> list[int]:
    path = out / "train_log.jsonl"
    return [r["step"] for r in train_log(out) if "loss" in r] if path.is_file() else []


def losses_by_step(out: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run appends to the same log)."""
    return {r["step"]: r["loss"] for r in train_log(out) if "loss" in r}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


SHAPES = OrderedDict([("model.embed_tokens.weight", (8, 4)), ("lm_head.weight", (8, 4))])


def master_weights(step: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights a checkpoint of `make_checkpoint` holds (distinct per parameter and step)."""
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 8 + i + step
            for i, (name, shape) in enumerate(SHAPES.items())}


def make_checkpoint(root: Path, step: int, world_size: int = 2, marked: bool = True, weights: dict | None = None,
                    loss: float = 3.0, masters: dict | None = None) -> Path:
    """A checkpoint-N folder with every file a 2-rank ZeRO-3 save writes (tiny contents), in DeepSpeed's
    layout: each rank's optimizer states hold its partition of `masters` (default `master_weights(step)`;
    padded flat group), so `zero_to_fp32` (and `hf-zero3 export`) rebuild them."""
    folder = root / f"checkpoint-{step}"
    tag = folder / f"global_step{step}"
    tag.mkdir(parents=True)
    (folder / "latest").write_text(tag.name)
    masters = master_weights(step) if masters is None else masters
    parts = [(numel := -(-w.numel() // world_size), torch.nn.functional.pad(w.flatten(), (0, numel * world_size
                                                                                          - w.numel())))
             for w in masters.values()]
    for rank in range(world_size):
        states = {"param_shapes": [OrderedDict((k, v.shape) for k, v in masters.items())],
                  "dp_world_size": world_size, "shared_params": {}, "frozen_param_shapes": None,
                  "buffer_names": [], "module": {}, "ds_version": "0.19.8",
                  "ds_config": {"zero_optimization": {"stage": 3,
                                                      "stage3_gather_16bit_weights_on_model_save": True}}}
        torch.save(states, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        flat = torch.cat([padded[rank * numel:(rank + 1) * numel] for numel, padded in parts])
        optim = {"optimizer_state_dict": {"zero_stage": 3, "partition_count": world_size,
                                          "fp32_flat_groups": [flat]}}
        torch.save(optim, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({"cpu": torch.get_rng_state()}, folder / f"rng_state_{rank}.pth")
    history = [{"step": step, "loss": loss}]
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    tensors = weights if weights is not None else masters
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if marked:
        ckpt.write_marker(folder, {"world_size": world_size})
    return folder


@pytest.fixture
def single_rank_env(monkeypatch):
    """Rank variables present, so an in-process `hf_zero3.run.train.main` leaves the process environment alone."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(autouse=True)
def _reset_hf_deepspeed_state():
    """Each test leaves the process as it found it: transformers' global DeepSpeed config, and the environment, which
    TrainingArguments writes to (ACCELERATE_USE_DEEPSPEED=true after a ds_config) and every later subprocess
    inherits (a plain run would then start as a DeepSpeed one)."""
    environment = dict(os.environ)
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)


def make_unreadable(path: Path) -> Path:
    """A path that exists but cannot be opened for reading (pytest.skip where this machine has none to offer).

    chmod 000 does not stop root, so as root the path links to a write-only sysfs file, which the kernel refuses
    to open for reading to anyone.
    """
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


@pytest.fixture
def unreadable(tmp_path):
    """`unreadable(name)`: a path under tmp_path that exists but cannot be opened for reading (`make_unreadable`)."""
    return lambda name: make_unreadable(tmp_path / name)
