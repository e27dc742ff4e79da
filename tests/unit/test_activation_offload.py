"""Activation offload's hooks on a real tiny Llama (CPU: the copy path, same pack/unpack as on GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_zero3.model import activation_offload as ao
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model")).train()


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [True, False])
def test_same_loss_and_gradients_and_everything_released(tiny, checkpointing):
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(1))
    a, b = copy.deepcopy(tiny), copy.deepcopy(tiny)
    if checkpointing:
        for m in (a, b):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offloader = ao.enable(b)
    (la, ga), (lb, gb) = _grads(a, ids), _grads(b, ids)
    assert torch.equal(la, lb) and all(torch.equal(ga[k], gb[k]) for k in ga)
    t, h = 4 * 128, 128
    if checkpointing:  # 4 layer inputs + the final norm's input and normalized output, fp32
        assert (offloader.stats.tensors, offloader.stats.bytes) == (6, 6 * t * h * 4)
    else:
        assert offloader.stats.bytes > 10 * 6 * t * h * 4 and offloader.stats.kept_params > 0
    assert offloader.stats.host_bytes == 0 and offloader.stats.peak_host_bytes == offloader.stats.bytes


def test_parameters_are_never_packed(tiny):
    m = copy.deepcopy(tiny)
    offloader = ao.enable(m, min_bytes=0)
    packed = []
    pack = offloader._pack
    offloader._pack = lambda t: packed.append(t) or pack(t)
    m(input_ids=torch.randint(0, 1024, (2, 16)), labels=torch.randint(0, 1024, (2, 16))).loss.backward()
    assert offloader.stats.kept_params > 0  # the weights the linears saved were seen ...
    kept = [t for t in packed if isinstance(t, torch.nn.Parameter)]
    assert kept and all(pack(t) is t for t in kept)  # ... and handed back as they are


def test_a_tensor_saved_twice_is_copied_once():
    offloader = ao.ActivationOffloader(min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with offloader.context():
        y = torch.randn(64, 64)
        out = (x * y).sum() + (x * y.t().t()).sum()  # y saved by two muls (the second through a view)
    assert offloader.stats.tensors == 1 and offloader.stats.bytes == 64 * 64 * 4
    out.backward()
    assert torch.allclose(x.grad, 2 * y)


def test_eval_and_no_grad_forwards_are_left_alone_and_disable_restores(tiny):
    m = copy.deepcopy(tiny)
    offloader = ao.enable(m)
    assert ao.enable(m) is offloader  # once per model
    ids = torch.randint(0, 1024, (2, 128))
    with torch.no_grad():
        m(input_ids=ids)
    m.eval()
    m(input_ids=ids)
    assert offloader.stats.tensors == 0
    m.train()
    m(input_ids=ids)
    assert offloader.stats.tensors > 0
    ao.disable(m)
    assert "forward" not in vars(ao.decoder_of(m)) and not hasattr(ao.decoder_of(m), "_hf_zero3_offloader")


def test_the_decoder_is_the_base_model(tiny):
    assert ao.decoder_of(tiny) is tiny.model
    assert ao.decoder_of(torch.nn.Linear(2, 2)).__class__ is torch.nn.Linear


def test_requested_by_the_ds_config_only_when_cpu_checkpointing_is_true_and_the_argument_is_unset():
    from hf_zero3.job.facts import activation_offload_of

    asks = {"activation_checkpointing": {"cpu_checkpointing": True}}
    assert activation_offload_of(None, asks) and not activation_offload_of(False, asks)
    assert not activation_offload_of(None, {"activation_checkpointing": {"partition_activations": True}})
    assert not activation_offload_of(None, {"activation_checkpointing": {"cpu_checkpointing": "true"}})
    assert not activation_offload_of(None, None) and activation_offload_of(True, None)


def test_train_switches_it_on_from_the_training_argument(tiny, tmp_path, capsys):
    from hf_zero3.job.arguments import TrainingArguments
    from hf_zero3.model.prepare import _maybe_offload_activations

    m = copy.deepcopy(tiny)
    _maybe_offload_activations(m, TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    assert not hasattr(m.model, "_hf_zero3_offloader")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], activation_offload=True)
    _maybe_offload_activations(m, args)
    assert isinstance(m.model._hf_zero3_offloader, ao.ActivationOffloader)
    assert "activation offload on (activation_offload)" in capsys.readouterr().out


def test_min_bytes_must_not_be_negative():
    with pytest.raises(ValueError, match="min_bytes must be >= 0"):
        ao.ActivationOffloader(min_bytes=-1)
