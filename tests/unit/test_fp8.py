"""`fp8: true` (hf_zero3/model/fp8.py): which linears become torchao's Float8Linear, that names and weights stay as
checkpoints know them, what a converted layer keeps for backward (why regional_compile is required), and the
arguments refused before anything starts. The 2-rank ZeRO-3 run is in tests/integration/test_regional_compile.py."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_zero3.model import fp8
from tests.conftest import ROOT, explain, run


def _model(folder: str = "assets/tiny/model", **overrides) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(ROOT / folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _float8(model) -> list[str]:
    return sorted(name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear")


def test_the_decoder_layers_linears_convert_and_names_and_weights_stay():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    converted = fp8.enable(model, emulate=True)
    assert sorted(converted) == _float8(model)
    assert len(converted) == 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers
    assert all(name.startswith("model.layers.") for name in converted)
    assert type(model.lm_head) is torch.nn.Linear  # its logits feed the loss
    after = model.state_dict()
    assert list(after) == list(before)  # checkpoints and exports see the names they know
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_misaligned_linears_and_routers_stay_in_high_precision():
    model = _model(intermediate_size=360)  # 360 % 16 != 0: the MLP cannot take _scaled_mm
    assert {name.rsplit(".", 1)[-1] for name in fp8.enable(model, emulate=True)} == {"q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"}
    router = torch.nn.Linear(128, 64)  # one output per expert of a 64-expert model
    assert not fp8.converts(router, "model.layers.0.mlp.gate", ("model.layers.0.",), experts=64)
    assert fp8.converts(router, "model.layers.0.mlp.gate", ("model.layers.0.",), experts=0)
    assert not fp8.converts(router, "lm_head", ("model.layers.0.",), experts=0)
    moe = _model("assets/tiny/qwen3-moe")
    converted = fp8.enable(moe, emulate=True)
    assert converted and not any(".mlp." in name for name in converted)  # fused experts are 3-D tensors, not linears


def _saved_views_of_parameters(model) -> tuple[int, int]:
    """(parameters saved for backward as themselves, views of a parameter saved) in one forward of `model`."""
    params = {id(p) for p in model.parameters()}
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counts = [0, 0]

    def pack(tensor):
        if id(tensor) in params:
            counts[0] += 1
        elif tensor.untyped_storage().data_ptr() in storages:
            counts[1] += 1
        return tensor

    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(input_ids=ids)  # the decoder only: the lm_head is outside fp8 and the compiled layers
    return counts[0], counts[1]


def test_compiled_layers_save_the_weights_themselves_where_uncompiled_float8_saves_views_of_them():
    eager = _model()
    fp8.enable(eager, emulate=True)
    assert _saved_views_of_parameters(eager)[1] >= 28  # weight.t() per Float8Linear: ZeRO-3 cannot release it
    compiled = _model()
    fp8.enable(compiled, emulate=True)
    for layer in compiled.model.layers:
        layer.forward = torch.compile(layer.forward, backend="aot_eager")
    themselves, views = _saved_views_of_parameters(compiled)
    assert views == 0 and themselves >= 28  # what ZeRO-3 gathers again for backward


def test_fp8_trains_a_step_close_to_high_precision():
    plain, converted = _model(), _model()
    fp8.enable(converted, emulate=True)
    ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, converted):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grad = model.model.layers[0].mlp.down_proj.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    assert losses[1] == pytest.approx(losses[0], rel=1e-2) and losses[1] != losses[0]


@pytest.mark.parametrize(("values", "phrase"), [
    ({"fp8": True}, "needs regional_compile: true"),
    ({"fp8": True, "regional_compile": True, "fp8_recipe": "delayed"}, "fp8_recipe 'delayed': choose one of"),
    ({"fp8": True, "regional_compile": True, "peft": {"r": 8}}, "drop fp8"),
    ({"fp8": True, "regional_compile": True, "fp16": True}, "use bf16 true"),
    ({"fp8": True, "regional_compile": True, "regional_compile_backend": "eager"}, "use inductor or aot_eager"),
])
def test_arguments_fp8_cannot_run_with_are_refused_naming_the_fix(values, phrase):
    found = fp8.problems(values, device="cpu")
    assert len(found) == 1 and phrase in found[0], found


def test_a_gpu_without_fp8_tensor_cores_and_a_missing_torchao_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA A100-SXM4-80GB")
    [found] = fp8.problems({"fp8": True, "regional_compile": True}, device="cuda")
    assert "compute capability 8.9+" in found and "A100-SXM4-80GB has 8.0: drop fp8" in found
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    assert fp8.problems({"fp8": True, "regional_compile": True}, device="cuda") == []
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an environment without torchao imports
    [found] = fp8.problems({"fp8": True, "regional_compile": True}, device="cuda")
    assert "fp8 needs torchao" in found and "pip install torchao" in found


def test_fp8_on_a_cpu_or_off_needs_nothing_more():
    assert fp8.problems({"fp8": True, "regional_compile": True}, device="cpu") == []
    assert fp8.problems({"regional_compile": True}, device="cuda") == []


def test_importing_the_trainer_with_torchao_installed_prints_nothing_of_torchao():
    done = run([sys.executable, "-c", "import hf_zero3.job.arguments, torchao.float8"])
    assert done.returncode == 0, explain(done)
    assert "torchao" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr
