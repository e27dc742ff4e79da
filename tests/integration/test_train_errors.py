"""`hf-zero3 train` on bad input through real entry points: exit 2 on every rank, one message naming the fix, no
traceback, nothing written. Few 2-rank runs: they are the slow part of the suite."""

from __future__ import annotations

import sys

import pytest

from hf_zero3.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, run

pytestmark = pytest.mark.integration


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


def test_unreachable_dataset_name_is_a_clean_error(tmp_path):
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "hf_zero3.train", TINY_YAML, "--deepspeed", "null", "--train_file", "null",
                "--validation_file", "null", "--dataset_name", "hf-zero3-tests/no-such-dataset",
                "--output_dir", out], HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, explain(proc)
    assert "error: dataset_name 'hf-zero3-tests/no-such-dataset' could not be loaded" in proc.stderr
    assert "HF_HUB_OFFLINE=1" in proc.stderr and "pass train_file with a local file instead" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not out.exists()
