"""`regional_compile` under real 2-rank ZeRO-3 on CPU (the tiny recipe, through `deepspeed`): every decoder layer's
forward is one compiled graph, shared by all layers, with no graph break (ZeRO-3's hooks stay outside it), with
checkpointing on some layers and not others; and it trains to the same losses and gradient norms as uncompiled.
With `fp8` (float8 emulated on CPU) it trains close to them and saves plain weights.
The compiler here is dynamo + AOTAutograd (`aot_eager`: the tracing, without inductor's code generation, which takes a
minute cold on two cores); tests/gpu/test_speed_levers_gpu.py runs inductor with Liger on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_zero3.checkpoint.contents import verify_checkpoint
from hf_zero3.job.distributed import free_port
from tests.conftest import TINY_YAML, explain, run, train_log

pytestmark = pytest.mark.integration

COMMON = ["--max_steps", "4", "--logging_steps", "1", "--save_strategy", "no", "--validation_file", "null",
          "--save_final_model", "false", "--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs",
          '{"use_reentrant": false}', "--gradient_checkpointing_layers", "2"]


def _steps(out) -> list[float]:
    """Loss and gradient norm of each step, in turn."""
    return [r[k] for r in train_log(out) if "loss" in r and "train_runtime" not in r for k in ("loss", "grad_norm")]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The uncompiled run both tests compare with: its output folder."""
    out = tmp_path_factory.mktemp("plain")
    done = run(["deepspeed", "--num_gpus", "2", "--master_port", free_port(), "--module", "hf_zero3.train",
                TINY_YAML, "--output_dir", out, *COMMON])
    assert done.returncode == 0, explain(done)
    return out


def test_compiled_layers_train_like_uncompiled_under_zero3_in_one_graph(tmp_path, plain):
    compiled = run(["deepspeed", "--num_gpus", "2", "--master_port", free_port(), "tests/integration/compile_probe.py",
                    tmp_path / "probe", TINY_YAML, "--output_dir", tmp_path / "compiled", *COMMON,
                    "--regional_compile", "true", "--regional_compile_backend", "aot_eager"])
    assert compiled.returncode == 0, explain(compiled)
    assert "hf_zero3: regional compile on: 4 LlamaDecoderLayer blocks compiled in place (backend aot_eager)" \
        in compiled.stdout
    for rank in (0, 1):
        probe = json.loads((tmp_path / "probe" / f"rank{rank}.json").read_text())
        assert probe["layers"] == [True] * 4 and probe["compiled_modules"] == ["LlamaDecoderLayer"]
        counters = probe["counters"]
        assert not counters.get("graph_break"), counters.get("graph_break")  # ZeRO-3's hooks stay outside
        assert not counters.get("recompiles")
        # one graph per checkpointing mode (2 layers recomputed, 2 not), whatever the number of layers
        assert 1 <= counters["stats"]["unique_graphs"] <= 2, counters["stats"]
    expected = _steps(plain)
    assert len(expected) == 8
    assert _steps(tmp_path / "compiled") == pytest.approx(expected, rel=1e-5)


def test_fp8_layers_train_close_to_high_precision_and_save_plain_weights(tmp_path, plain):
    out = tmp_path / "fp8"
    done = run(["deepspeed", "--num_gpus", "2", "--master_port", free_port(), "--module", "hf_zero3.train", TINY_YAML,
                "--output_dir", out, *COMMON, "--save_strategy", "steps", "--save_steps", "4", "--save_final_model",
                "true", "--fp8", "true", "--regional_compile", "true", "--regional_compile_backend", "aot_eager"])
    assert done.returncode == 0, explain(done)
    assert "hf_zero3: fp8 on: 28 linear layers" in done.stdout
    steps, expected = _steps(out), _steps(plain)
    assert steps == pytest.approx(expected, rel=2e-2) and steps != pytest.approx(expected, rel=1e-6)
    assert verify_checkpoint(out / "checkpoint-4") == []  # every weight gathered, with its name and shape
    saved = AutoModelForCausalLM.from_pretrained(out)  # a plain model: nothing of torchao in the weights
    assert type(saved.model.layers[0].self_attn.q_proj) is torch.nn.Linear
