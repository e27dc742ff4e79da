"""hf_zero3: DeepSpeed ZeRO-3 recipes, config generator and Trainer callbacks for Hugging Face causal LMs."""

import logging
import warnings

__version__ = "0.1.0"


def _not_torchao_import_noise(record: logging.LogRecord) -> bool:
    """False for the two warnings every process that imports transformers' Trainer prints once torchao is installed
    (peft imports it): torchao's CUDA kernels (`_C*.so`) failing to load into a CPU build of torch, and torch's
    notice to torchao that registering its enums with pytree is deprecated. Neither is the user's to act on, and
    float8 training (`fp8`) uses neither those kernels nor that registration. Every other record passes."""
    import sys

    message = record.getMessage()
    torch = sys.modules.get("torch")
    cpu_build = torch is not None and getattr(torch.version, "cuda", None) is None
    kernels = cpu_build and message.startswith("Failed to load") and "/torchao/_C" in message
    registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
    enums = "is an Enum subclass" in message and getattr(registered, "__module__", "").startswith("torchao")
    return not (kernels or enums)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_not_torchao_import_noise)

# DeepSpeed 0.19's ZeRO calls torch.distributed's reduce_scatter_tensor and all_gather_into_tensor in every step, which
# torch 2.13 deprecates with a FutureWarning. Something in each step resets Python's once-per-place record, so the
# warning came back every step: 7,269 times in the tiny recipe's 100 steps. Nothing there is the user's to change.
warnings.filterwarnings("ignore", category=FutureWarning,
                        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")
