"""GPU-only checks of the speed levers and the honest baselines (marker `gpu`; skipped without CUDA). Run on a GPU box:
`python -m pytest tests/gpu/test_speed_levers_gpu.py -m gpu` (about 3 minutes on one H200).

- regional_compile with inductor and Liger (its fused linear cross-entropy stays outside the compiler: the Trainer's
  whole-model `torch_compile` fails with it in triton.cdiv; Liger's layer kernels are off with compiled layers),
  under ZeRO-3: it trains, to the losses of uncompiled bf16 within bf16's rounding, with one compiled graph for all
  layers and no graph break; with `fp8` too, on the FP8 tensor cores, close to them;
- `hf-zero3 bench`'s micro batch search: a tuned baseline started at a micro batch that runs out of GPU memory is
  recorded as such and searched down to one that fits, which the report then counts.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_zero3.job.distributed import free_port
from tests.conftest import TINY_YAML, explain, run, train_log

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WIDE = "hidden_size=2048,intermediate_size=5632,num_attention_heads=16,num_key_value_heads=4,head_dim=128"
"""The tiny model at a width where the GPU, not Python, sets the pace; still its 1024-token vocabulary."""


def test_regional_compile_with_liger_trains_like_uncompiled_under_zero3_and_with_fp8_close_to_it(tmp_path):
    common = ["--max_steps", "6", "--logging_steps", "1", "--save_strategy", "no", "--validation_file", "null",
              "--save_final_model", "false", "--bf16", "true", "--use_liger_kernel", "true", "--config_overrides",
              WIDE, "--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs", '{"use_reentrant": false}',
              "--per_device_train_batch_size", "4"]
    plain = run(["deepspeed", "--num_gpus", "1", "--master_port", free_port(), "--module", "hf_zero3.train",
                 TINY_YAML, "--output_dir", tmp_path / "plain", *common])
    assert plain.returncode == 0, explain(plain)
    compiled = run(["deepspeed", "--num_gpus", "1", "--master_port", free_port(), "tests/integration/compile_probe.py",
                    tmp_path / "probe", TINY_YAML, "--output_dir", tmp_path / "compiled", *common,
                    "--regional_compile", "true"])
    assert compiled.returncode == 0, explain(compiled)
    counters = json.loads((tmp_path / "probe" / "rank0.json").read_text())["counters"]
    assert not counters.get("graph_break") and counters["stats"]["unique_graphs"] <= 2, counters

    def losses(out):
        return [r["loss"] for r in train_log(out) if "loss" in r and "train_runtime" not in r]

    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "plain"), rel=2e-2)
    fp8 = run(["deepspeed", "--num_gpus", "1", "--master_port", free_port(), "--module", "hf_zero3.train", TINY_YAML,
               "--output_dir", tmp_path / "fp8", *common, "--regional_compile", "true", "--fp8", "true"])
    assert fp8.returncode == 0, explain(fp8)
    assert "on FP8 tensor cores" in fp8.stdout
    assert losses(tmp_path / "fp8") == pytest.approx(losses(tmp_path / "plain"), rel=5e-2)


def test_bench_searches_a_tuned_micro_batch_down_after_out_of_memory(tmp_path):
    """The plain Trainer at this width without checkpointing: micro 512 x 512 tokens needs activations far past any
    GPU (4 layers x 262,144 tokens x ~100 KB), a smaller one fits."""
    out, work = tmp_path / "report", tmp_path / "work"
    proc = run(["python", "-m", "hf_zero3", "bench", "tiny", "--gpus", "1", "--steps", "1", "--warmup", "1",
                "--against", "plain_tuned", "--tuned", "plain_tuned=512", "--only", "plain_tuned", "--run-timeout", "300",
                "--out", out,
                "--work-dir", work, "--", "--per_device_train_batch_size", "512", "--block_size", "512",
                "--bf16", "true", "--config_overrides", WIDE], timeout=1800)
    assert proc.returncode == 0, explain(proc)
    [report] = out.glob("tiny_*.md")
    text = report.read_text()
    assert "| plain_tuned_512 | failed: out of memory at micro batch 512" in text, text
    ran = [line for line in text.splitlines() if line.startswith("| plain_tuned_") and "failed" not in line]
    assert ran, text  # a smaller micro batch fitted and was measured
    assert "**The best baseline: plain_tuned_" in text and "counted as results, not dropped): plain_tuned_512" in text
