"""`hf_zero3.train` plus a callback that records, per rank, what ZeRO-3 holds of a LoRA run (the frozen base's
partition, the optimizer's fp32 elements) when training begins, what decoder layer 1 keeps for backward in the first
forward (with the parameters' dtypes and whether ZeRO-3's linear (`model.zero3_linear`) replaced F.linear), and rank 0's logits of a fixed
input when it ends (launched like training:
`torchrun --nproc_per_node 2 tests/integration/lora_probe.py PROBE_DIR CONFIG [overrides]`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_zero3.job.distributed import exit_process  # as hf_zero3.train ends: no abort in C++ teardown
from hf_zero3.train import main

PROBE_INPUT = torch.arange(3, 67).reshape(1, 64)
"""The tokens whose logits the trained model gives at the end (any ids below the tiny vocab)."""


class LoraProbe(TrainerCallback):
    def __init__(self, folder: Path):
        self.folder, self.rank = folder, int(os.environ.get("RANK", "0"))

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        zero = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper around DeepSpeed's ZeRO-3 optimizer
        frozen = [p for p in model.parameters() if not p.requires_grad]
        (self.folder / f"rank{self.rank}.json").write_text(json.dumps({
            "trainable": sum(p.ds_numel for p in model.parameters() if p.requires_grad),
            "frozen_whole": sum(p.ds_numel for p in frozen),
            "frozen_partition": sum(p.ds_tensor.numel() for p in frozen),
            "optimizer_fp32": sum(g.numel() for g in zero.fp32_partitioned_groups_flat),
            "checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in model.modules()),
        }))
        if not args.gradient_checkpointing:  # the checkpoint's own saved-tensor hooks own a checkpointed forward
            self._watch_layer(model)

    def _watch_layer(self, model):
        """The unique storages decoder layer 1 saves for backward in the first forward (parameters excepted)."""
        from hf_zero3.model.zero3_linear import zero3_linear

        layer = next(m for name, m in model.named_modules() if name.endswith("layers.1"))
        params, saved, done = {id(p) for p in model.parameters()}, {}, []

        def pack(tensor):
            if id(tensor) not in params and not isinstance(tensor, torch.nn.Parameter) and tensor.numel():
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

        def before(module, inputs):
            if not done:
                hooks.__enter__()

        def after(module, inputs, output):
            if done:
                return
            hooks.__exit__(None, None, None)
            done.append(True)
            (self.folder / f"saved{self.rank}.json").write_text(json.dumps({
                "saved_bytes": sum(saved.values()), "tokens": inputs[0].shape[0] * inputs[0].shape[1],
                "zero3_linear": torch.nn.functional.linear is zero3_linear,
                "dtypes": {kind: sorted({str(p.dtype) for n, p in model.named_parameters() if ("lora_" in n) == lora})
                           for kind, lora in (("adapter", True), ("base", False))},
            }))

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.eval()
        with torch.no_grad():  # every rank: ZeRO-3 gathers each layer for the forward
            logits = model(input_ids=PROBE_INPUT.to(args.device)).logits.float().cpu()
        model.train()
        if self.rank == 0:
            torch.save(logits, self.folder / "logits.pt")


if __name__ == "__main__":
    argv = sys.argv[1:]
    at = next(i for i, a in enumerate(argv) if not a.startswith("--local_rank"))  # DeepSpeed's launcher prepends it
    folder = Path(argv.pop(at))
    folder.mkdir(parents=True, exist_ok=True)
    exit_process(main(argv, extra_callbacks=[LoraProbe(folder)]))
