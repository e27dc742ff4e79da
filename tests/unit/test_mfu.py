"""MFU on every GPU: the peak table, `--peak-tflops` on train and bench, an unknown GPU
that says how to set the peak; and eval_perplexity in the log record every `report_to` integration receives."""

from __future__ import annotations

import math
import types

import pytest

from hf_zero3.callbacks import ThroughputCallback, throughput
from hf_zero3.callbacks.throughput import peak_tflops_of
from tests.conftest import error_naming


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA A100-SXM4-40GB", 312), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 80GB HBM3", 989),
    ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA L40S", 362),
    ("NVIDIA L40", 181), ("NVIDIA L4", 121), ("NVIDIA A10G", 70), ("NVIDIA A10", 125),
    ("Tesla V100-SXM2-32GB", 125), ("Tesla V100-PCIE-16GB", 112), ("NVIDIA GeForce RTX 4090", 165),
    ("NVIDIA B200", 2250), ("NVIDIA RTX 6000 Ada Generation", None), ("Acme Tensor X1", None)])
def test_peak_by_the_name_torch_gives(name, peak):
    assert peak_tflops_of(name) == peak


def _logged(callback, peak_gpu=None):
    args = types.SimpleNamespace(include_num_input_tokens_seen="no", per_device_train_batch_size=1,
                                 gradient_accumulation_steps=1, world_size=1)
    state = types.SimpleNamespace(global_step=0, num_input_tokens_seen=0, is_world_process_zero=True,
                                  log_history=[])
    callback.on_train_begin(args, state, None)
    state.global_step = 2
    logs = {"loss": 1.0}
    callback.on_log(args, state, None, logs=logs)
    return logs


def test_a_given_peak_gives_mfu_and_a_bad_one_is_refused():
    logs = _logged(ThroughputCallback(seq_len=8, flops_per_token=1e6, peak_tflops=1e-6))
    assert logs["mfu"] == pytest.approx(logs["tflops_per_gpu"] / 1e-6, rel=1e-3)
    with pytest.raises(ValueError, match="pass --peak-tflops N"):
        ThroughputCallback(seq_len=8, peak_tflops=0)


def test_an_unknown_gpu_says_how_to_set_the_peak(monkeypatch, capsys):
    monkeypatch.setattr(throughput, "gpu_name", lambda: "Acme Tensor X1")  # no such GPU here: its name only
    logs = _logged(ThroughputCallback(seq_len=8, flops_per_token=1e6))
    assert "mfu" not in logs and "tflops_per_gpu" in logs
    error_naming(capsys.readouterr().out, "no MFU", "Acme Tensor X1", "--peak-tflops N")
    logs = _logged(ThroughputCallback(seq_len=8, flops_per_token=1e6, peak_tflops=100.0))
    assert "mfu" in logs and capsys.readouterr().out == ""


def test_bench_takes_peak_tflops_and_refuses_a_bad_one(capsys):
    from hf_zero3.cli import build_parser

    assert build_parser().parse_args(["bench", "tiny", "--peak-tflops", "756"]).peak_tflops == 756.0
    for bad in ("0", "-1", "inf", "fast"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "tiny", "--peak-tflops", bad])
        assert "--peak-tflops: must be a positive number" in capsys.readouterr().err


def test_train_logs_mfu_with_peak_tflops_and_eval_perplexity_reaches_the_integrations(single_rank_env, tmp_path):
    """A real (single-process, CPU) run: the recorder sits where TensorBoard/W&B sit, after our callbacks."""
    from transformers import TrainerCallback

    from hf_zero3.run.train import main
    from tests.conftest import TINY_YAML, train_log

    class Integration(TrainerCallback):
        def __init__(self):
            self.records = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.records.append(dict(logs))

    integration = Integration()
    argv = [str(TINY_YAML), "--deepspeed", "null", "--max_steps", "2", "--logging_steps", "1", "--save_strategy",
            "no", "--eval_strategy", "steps", "--eval_steps", "1", "--max_eval_samples", "4",
            "--peak-tflops", "0.001", "--output_dir", str(tmp_path / "run")]
    assert main(argv, extra_callbacks=[integration]) == 0
    evals = [r for r in integration.records if "eval_loss" in r]
    assert len(evals) == 3  # steps 1 and 2, and the final evaluation
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)
    assert all(r["mfu"] > 0 for r in integration.records if "loss" in r)
    assert [r for r in train_log(tmp_path / "run") if "eval_perplexity" in r]
    assert (tmp_path / "run" / "train_log.png").read_bytes()[:4] == b"\x89PNG"  # drawn at the end, rank 0
