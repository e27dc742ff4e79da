"""ZeRO-3's linear (`model.zero3_linear`): DeepSpeed's function, keeping a layer's input only for a weight that trains;
the gradients are DeepSpeed's and torch's to the bit."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.zero.linear import zero3_linear_wrap

from hf_zero3.model import zero3_linear


def _run(linear, weight_trains: bool, bias: bool = True):
    """(the shapes the forward saved for backward, parameters excepted; the gradients of input, weight and bias)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(5, 8), requires_grad=weight_trains)
    b = torch.nn.Parameter(torch.randn(5)) if bias else None
    params, saved = {weight.data_ptr(), *([b.data_ptr()] if bias else [])}, []

    def pack(tensor):
        if tensor.data_ptr() not in params:
            saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = linear(x * 2, weight, b)
    y.pow(2).sum().backward()
    return saved, [t.grad for t in (x, weight, b) if t is not None]


def _same(ours, theirs) -> bool:
    return len(ours) == len(theirs) and all(a is b is None or (a is not None and b is not None and torch.equal(a, b))
                                            for a, b in zip(ours, theirs))


@pytest.mark.parametrize("bias", [True, False])
def test_a_frozen_weight_keeps_no_input_and_the_gradients_are_deepspeeds(bias):
    saved, grads = _run(zero3_linear.zero3_linear, weight_trains=False, bias=bias)
    theirs_saved, theirs = _run(zero3_linear_wrap, weight_trains=False, bias=bias)
    assert theirs_saved == [(2, 3, 8)] and saved == []  # DeepSpeed's keeps the input nobody needs
    assert grads[1] is None and _same(grads, theirs) and _same(grads, _run(torch._C._nn.linear, False, bias)[1])


def test_a_weight_that_trains_is_handled_as_deepspeed_handles_it():
    saved, grads = _run(zero3_linear.zero3_linear, weight_trains=True)
    theirs_saved, theirs = _run(zero3_linear_wrap, weight_trains=True)
    assert saved == theirs_saved == [(2, 3, 8)]
    assert grads[1] is not None and _same(grads, theirs)


def test_install_replaces_deepspeeds_linear_and_nothing_else(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "linear", torch._C._nn.linear)
    assert not zero3_linear.install() and torch.nn.functional.linear is torch._C._nn.linear
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)  # as zero.Init leaves it
    assert zero3_linear.install() and torch.nn.functional.linear is zero3_linear.zero3_linear
    assert not zero3_linear.install()  # once
