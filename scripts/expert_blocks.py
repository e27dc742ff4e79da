"""Every mixture-of-experts family this transformers ships, built on the meta device from its default config (no
download): how its experts are laid out and which module `hf_zero3.plan.experts` makes the ZeRO-3 leaf.

Prints the markdown table of docs/experts.md: python scripts/expert_blocks.py
"""

from __future__ import annotations

import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_zero3.plan.experts import expert_containers, expert_count, leaf_modules

LAYERS = 6
"""Enough layers to pass the dense first layers some families keep (DeepSeek-V3: 3)."""


def main() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    deepspeed_defaults = {name.rpartition(".")[2] for name in DEFAULT_LEAF_MODULE_CLASSES}
    print(f"transformers {transformers.__version__}, {LAYERS} layers each, meta device\n")
    print("| model_type | routed experts | experts held as | leaf module(s) | in DeepSpeed's defaults |")
    print("|---|---|---|---|---|")
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 -- a family whose default config cannot be built is skipped
            continue
        n = expert_count(config)
        if not n:
            continue
        config.num_hidden_layers = min(getattr(config, "num_hidden_layers", LAYERS) or LAYERS, LAYERS)
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except Exception as e:  # noqa: BLE001
            print(f"| {model_type} | {n} | (its default config does not build: {type(e).__name__}) | | |")
            continue
        modules = dict(model.named_modules())
        held = sorted({"ModuleList" if isinstance(modules[c], torch.nn.ModuleList) else
                       f"3-D tensors ({type(modules[c]).__name__})" for c in expert_containers(model, n)})
        leaves = sorted(set(leaf_modules(model).values()))
        print(f"| {model_type} | {n} | {', '.join(held) or 'none found'} | {', '.join(leaves) or '-'} | "
              f"{'yes' if leaves and set(leaves) <= deepspeed_defaults else 'no'} |")


if __name__ == "__main__":
    main()
