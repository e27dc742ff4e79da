"""`hf-zero3 train` on bad input through real entry points: exit 2 on every rank, one message naming the fix, no
traceback, nothing written. Few 2-rank runs: they are the slow part of the suite."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, run, subprocess_env

pytestmark = pytest.mark.integration


def run_ranks(args: list, tmp_path, world: int = 2) -> list[tuple[int, str]]:
    """`python -m hf_zero3.train ARGS` started once per rank by hand (as a launcher would: rank variables, one free
    port), so that each rank's own exit code is seen; no launcher kills the others when the first one exits."""
    port, procs = str(free_port()), []
    for rank in range(world):
        log = open(tmp_path / f"rank{rank}.log", "w+")  # noqa: SIM115 -- closed below
        env = subprocess_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                             LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append((subprocess.Popen([sys.executable, "-m", "hf_zero3.train", *map(str, args)], cwd=ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    for proc, log in procs:
        proc.wait(timeout=600)
        log.seek(0)
        results.append((proc.returncode, log.read()))
        log.close()
    return results


def test_missing_train_file_under_the_deepspeed_launcher_exits_2(tmp_path):
    out = tmp_path / "out"
    proc = run([ROOT / "recipes/tiny/launch.sh", "--train_file", "no/such/train.txt", "--output_dir", out],
               MASTER_PORT=str(free_port()))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert output.count("error: train_file 'no/such/train.txt' does not exist") == 1, explain(proc)  # rank 0 only
    assert "fix the path" in output
    assert "Traceback" not in output and "terminate called" not in output, explain(proc)
    assert not out.exists()


def test_missing_train_file_under_torchrun_exits_2_with_rank_0s_message(tmp_path):
    """torchrun itself always exits 1 and prints its own ChildFailedError traceback; the ranks are ours: rank 0
    prints the message and exits 2 first (the others wait), so it is the root cause torchrun names."""
    out = tmp_path / "out"
    proc = run(["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "-m", "hf_zero3.train",
                TINY_YAML, "--train_file", "no/such/train.txt", "--output_dir", out])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, explain(proc)
    assert output.count("error: train_file 'no/such/train.txt' does not exist") == 1, explain(proc)
    root_cause = output.split("Root Cause (first observed failure):")[-1]
    assert "rank      : 0" in root_cause and "exitcode  : 2" in root_cause, explain(proc)
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, explain(proc)  # torchrun's own
    assert "terminate called" not in output
    assert not out.exists()


def test_an_error_after_zero3_started_exits_2_on_every_rank(tmp_path):
    """The process group, DeepSpeed and a ZeRO-3 partitioned model exist when the data error comes: each rank
    still exits 2 (it used to abort at exit with 134, "terminate called without an active exception")."""
    short = tmp_path / "short.txt"
    short.write_text("Too short for one block.\n")  # found only once tokenized, after the process group started
    results = run_ranks([TINY_YAML, "--train_file", short, "--validation_file", "null", "--output_dir",
                         tmp_path / "out"], tmp_path)
    for rank, (code, log) in enumerate(results):
        assert code == 2, f"rank {rank}: exit {code}\n{log[-4000:]}"
        assert "Traceback" not in log and "terminate called" not in log, log[-4000:]
    message = "fewer than one block (block_size=128)"
    assert [message in log for _, log in results] == [True, False]  # rank 0 prints


def test_unreachable_dataset_name_is_a_clean_error(tmp_path):
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "hf_zero3.train", TINY_YAML, "--deepspeed", "null", "--train_file", "null",
                "--validation_file", "null", "--dataset_name", "hf-zero3-tests/no-such-dataset",
                "--output_dir", out], HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, explain(proc)
    assert "error: dataset_name 'hf-zero3-tests/no-such-dataset' could not be loaded" in proc.stderr
    assert "HF_HUB_OFFLINE=1" in proc.stderr and "train_file" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()


def test_a_finished_zero3_run_leaves_no_engine_and_no_process_group_thread_behind(tmp_path, single_rank_env):
    """The cause of the post-run aborts (exit 134, 250 under the launcher): DeepSpeed kept the ZeRO-3 engine, the
    model and the process groups alive after the run (a class-level lru_cache, a module-level module stack, hooks),
    so gloo's and the TCPStore's threads outlived `destroy_process_group` and were torn down in the interpreter's
    exit. A real ZeRO-3 run (one rank, in this process): once `main` returns, all of it is gone, and torch's own
    F.linear is back (zero.Init replaces it for the process's lifetime)."""
    import gc

    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    from hf_zero3.run.train import main
    from tests.unit.test_train_errors import _process_group_threads

    before = _process_group_threads()
    assert main([str(TINY_YAML), "--max_steps", "1", "--save_steps", "1", "--validation_file", "null",
                 "--output_dir", str(tmp_path / "o")]) == 0
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]
    assert not _process_group_threads() - before
    assert torch.nn.functional.linear is torch._C._nn.linear
