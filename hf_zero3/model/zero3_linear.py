"""ZeRO-3's linear function, keeping a layer's input for backward only when the layer's weight trains.

Why: `zero.Init` replaces `torch.nn.functional.linear` with DeepSpeed's `zero3_linear_wrap`, whose backward gathers a
partitioned weight again instead of holding the gathered copy. Its autograd function saves the layer's input
whatever needs a gradient, yet the input serves only the weight's gradient: with a frozen weight (a LoRA run's base)
every linear layer keeps an activation that torch's own linear drops. For Llama-3-8B that is the two norms' outputs
and the SwiGLU product, 45,056 B per token and layer in bf16. This function is DeepSpeed's with that one difference;
a weight that trains is handled exactly as before.
"""

from __future__ import annotations

import sys

from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap


class Zero3Linear(LinearFunctionForZeroStage3):
    """DeepSpeed's ZeRO-3 linear; the input is saved only for a weight that requires a gradient."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, *bias = inputs
        LinearFunctionForZeroStage3.setup_context(ctx, (input if weight.requires_grad else None, weight, *bias),
                                                  output)


def zero3_linear(input, weight, bias=None):
    return Zero3Linear.apply(input, weight, bias)


def install() -> bool:
    """Put `zero3_linear` where `zero.Init` put DeepSpeed's (it stays for the process: the model's forward and a
    later `zero.Init` use this one, and `distributed.restore_torch_linear` gives torch's back); True if it did."""
    functional = sys.modules["torch.nn.functional"]
    if functional.linear is zero3_linear_wrap:
        functional.linear = zero3_linear
        return True
    return False

