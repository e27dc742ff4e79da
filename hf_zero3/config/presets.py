"""Named specs behind every committed config: `ds_configs/*.json` and `recipes/<name>/ds_config.json`.

`make configs` writes them all from here through `build_ds_config`; a test regenerates them and fails
on any difference, so no committed JSON is ever edited by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_zero3.config.build import build_ds_config
from hf_zero3.config.spec import OptimizerOffload, ParamOffload, ZeroSpec

NVME_PLACEHOLDER = "/local_nvme"
"""Where the NVMe configs offload to; edit it (or use `hf-zero3 config new --nvme-path`)."""

STANDALONE_CONFIGS: dict[str, ZeroSpec] = {
    # ZeRO-3, bf16: the default for Ampere/Hopper GPUs.
    "zero3": ZeroSpec(precision="bf16"),
    # ZeRO-3 following TrainingArguments' --bf16/--fp16 (the stock HF template, all "auto").
    "zero3_auto": ZeroSpec(precision="auto"),
    # ZeRO-3, fp16 with dynamic loss scaling: V100/T4 and other GPUs without bf16.
    "zero3_fp16": ZeroSpec(precision="fp16"),
    # ZeRO-2, bf16: models whose bf16 params and grads fit on every GPU; faster than ZeRO-3.
    "zero2": ZeroSpec(stage=2, precision="bf16"),
    # ZeRO-3 + optimizer states in host RAM (DeepSpeedCPUAdam).
    "zero3_offload_optimizer": ZeroSpec(precision="bf16", offload_optimizer=OptimizerOffload(device="cpu")),
    # ZeRO-3 + optimizer and params in host RAM: the largest model per GPU short of NVMe.
    "zero3_offload_all": ZeroSpec(
        precision="bf16",
        offload_optimizer=OptimizerOffload(device="cpu"),
        offload_param=ParamOffload(device="cpu"),
        sub_group_size=100_000_000,
    ),
    # ZeRO-3 + optimizer and params on a local NVMe mount (ZeRO-Infinity).
    "zero3_nvme": ZeroSpec(
        precision="bf16",
        offload_optimizer=OptimizerOffload(device="nvme", nvme_path=NVME_PLACEHOLDER),
        offload_param=ParamOffload(device="nvme", nvme_path=NVME_PLACEHOLDER),
        sub_group_size=100_000_000,
    ),
}

RECIPE_CONFIGS: dict[str, ZeroSpec] = {
    # Runs on a laptop CPU (fp32, gloo) and on GPUs (pass --bf16 true): precision follows TrainingArguments.
    "tiny": ZeroSpec(precision="auto"),
    # Llama-3-8B on 2+ H100/H200: bf16 params, grads and Adam states fit partitioned; no offload, no checkpointing.
    # 5e8-element buckets (DeepSpeed's own defaults) instead of the bridge's hidden_size**2: 6791 and 5967
    # tokens/s/GPU in two runs vs 5919 with "auto" on 2xH200, +5 GiB; within run-to-run spread
    # (benchmarks study 8b-vs-stock).
    # v2 (train_args.yaml: Liger, micro 3 x 2) runs this same config: 10,121 tokens/s/GPU, 52.7% MFU, 118.9 GiB
    # (benchmarks study 8b-tuned). ZeRO-2 + Liger is not measured on 2 GPUs yet.
    "8b": ZeroSpec(precision="bf16", reduce_bucket_size=500_000_000, prefetch_bucket_size=500_000_000,
                   param_persistence_threshold=1_000_000, max_live_parameters=3_000_000_000),
    # 7b/13b/70b: the planner's cheapest fitting option for the recipe's target at its batch (`make plan-<size>`;
    # tests/unit/test_recipes.py re-asks the planner). Llama-2-7B on 8x A100-80GB: bf16 params + grads fit on
    # every GPU, so ZeRO-2 (no per-layer all-gathers) beats ZeRO-3.
    "7b": ZeroSpec(stage=2, precision="bf16"),
    # Llama-2-13B on 8x A100-80GB: ZeRO-2 fits only with activation checkpointing (gradient_checkpointing in the YAML).
    "13b": ZeroSpec(stage=2, precision="bf16", activation_checkpointing=True),
    # Llama-2-70B on 8x A100-40GB (v2): the planner's choice with 10% headroom for p4d.24xlarge, nd-a100-v4 and
    # 2 x a2-highgpu-4g (`hf-zero3 plan --model 70b --hardware p4d.24xlarge --headroom 0.1 --global-batch 64`):
    # ZeRO-3 + optimizer states on NVMe (ZeRO-Infinity) + checkpointing. v1 put them in host RAM: 1,362.7 GB per
    # node, more than any of those nodes has. Sub-groups of 1e8 keep the pinned NVMe swap buffers small.
    "70b": ZeroSpec(precision="bf16", offload_optimizer=OptimizerOffload(device="nvme", nvme_path=NVME_PLACEHOLDER),
                    sub_group_size=100_000_000, activation_checkpointing=True),
    # Llama-2-70B with a LoRA adapter on 8x A100-40GB: the frozen base needs only its 16-bit partitions (17.3 GB per
    # GPU) and the optimizer holds the adapter alone, so plain ZeRO-3 + checkpointing fits with no offload: the
    # planner's choice with 10% headroom for the machines of recipe 70b (`hf-zero3 plan --model 70b-lora --hardware
    # p4d.24xlarge --headroom 0.1 --global-batch 64`), where the full fine-tune needs the optimizer on NVMe.
    "70b-lora": ZeroSpec(precision="bf16", activation_checkpointing=True),
    # The largest full fine-tune on a 2 x H200 machine (256 GiB host, 128 GiB disk): a 20.7B Llama. Partial
    # optimizer offload: 5 of 11 sub-groups of fp32 master weights + Adam states stay on each GPU (ratio 0.5), the
    # rest in host RAM; checkpointing (`hf-zero3 plan --model 20b-h200x2 --hardware h200x2 --headroom 0.1`).
    # Host buffers not pinned: torch's caching host allocator rounds each pinned block up to a power of 2, and the
    # 20.7 GB flat gradient partition per rank would take 34.4 GB (+32 GB per node: no longer fits).
    # v2: saves write ZeRO shards (no 16-bit gathering): a gathering save puts a 16-bit copy of the whole model,
    # 41.4 GB, in rank 0's host RAM (measured on the 10b: +20.2 GiB for 20.0), past what the node has.
    "20b-h200x2": ZeroSpec(precision="bf16",
                           offload_optimizer=OptimizerOffload(device="cpu", ratio=0.5, pin_memory=False),
                           activation_checkpointing=True, gather_16bit_weights_on_save=False),
    # The largest full fine-tune on a 1 x H200 machine (125 GiB host, 64 GiB disk): a 10.7B Llama (SOLAR-10.7B's
    # shape), partial offload ratio 0.4, checkpointing (`hf-zero3 plan --model 10b-h200x1 --hardware h200x1`).
    # v2: saves write ZeRO shards, as for 20b-h200x2 (measured: a gathering save took the 125 GiB box from 92 to
    # 112 GiB). v3: host buffers pinned, with micro 4 x 2 in train_args.yaml: the fastest measured setting that fits
    # (10.3 s per step against 17.9 unpinned at micro 4 and 44-54 at v2's micro 1 x 8; host RAM 107.5-109.5 GiB of
    # 125 while training: benchmarks studies pinned-offload-10b and largest-fit-10b-micro4). It fits the planner
    # without headroom only (at 10% it keeps micro 1 x 8 unpinned): the measurement is the proof.
    # Qwen3-30B-A3B (a mixture of experts, 30.5B parameters) on 8 x H100 80GB: the planner's choice with 10% headroom
    # (`hf-zero3 plan --model qwen3-30b-a3b --hardware dgx-h100 --headroom 0.1 --global-batch 64`): 16 B/param of
    # states for every expert do not fit 8 x 80 GB, so 1 of each rank's 4 optimizer sub-groups goes to host RAM (ratio
    # 0.1; 2 of them, ratio 0.3, while the planner counted the whole fp32 logits that TRL's fused LM head never
    # builds), pinned; checkpointing. The MoE blocks' leaf modules are added at start (hf_zero3/model/experts.py), so
    # this ds_config also serves other MoE models.
    "qwen3-30b-a3b": ZeroSpec(precision="bf16", offload_optimizer=OptimizerOffload(device="cpu", ratio=0.1),
                              activation_checkpointing=True),
    "10b-h200x1": ZeroSpec(precision="bf16",
                           offload_optimizer=OptimizerOffload(device="cpu", ratio=0.4, pin_memory=True),
                           activation_checkpointing=True, gather_16bit_weights_on_save=False),
    # DPO of Llama-3-8B with a LoRA adapter on one H200 (`hf-zero3 plan --model 8b-dpo --hardware h200x1 --headroom
    # 0.1 --global-batch 64 --seq-len 2048 --no-liger`): the frozen base's 16-bit weights, the adapter's states and
    # both answers of each pair fit without offload or checkpointing; on one GPU ZeRO-3 partitions nothing, and the
    # planner orders ZeRO-2 first (no measurement of both there). The full fine-tune needs ZeRO-3 + partial optimizer
    # offload (ratio 0.4) + checkpointing at micro 4 x accumulation 16 (recipes/8b-dpo/README.md).
    "8b-dpo": ZeroSpec(stage=2, precision="bf16"),
    # DPO of Llama-2-70B with a LoRA adapter on 8 x A100-80GB (`hf-zero3 plan --model 70b-dpo-lora --hardware
    # dgx-a100-80 --headroom 0.1 --global-batch 64 --seq-len 2048 --no-liger`): ZeRO-3 partitions the frozen base,
    # checkpointing keeps the pairs' activations, no offload; the reference is the base with the adapter off (no
    # second copy).
    "70b-dpo-lora": ZeroSpec(precision="bf16", activation_checkpointing=True),
}


def generated_files(root: Path) -> dict[Path, dict]:
    """Every committed config path under `root`, with the dict it must hold."""
    files = {root / "ds_configs" / f"{name}.json": build_ds_config(spec) for name, spec in STANDALONE_CONFIGS.items()}
    for name, spec in RECIPE_CONFIGS.items():
        files[root / "recipes" / name / "ds_config.json"] = build_ds_config(spec)
    return files


def render(config: dict) -> str:
    """The canonical JSON text of a config (what is committed)."""
    return json.dumps(config, indent=2) + "\n"


def write_configs(root: Path) -> list[Path]:
    """Write every generated config; returns the paths written."""
    written = []
    for path, config in generated_files(root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(config))
        written.append(path)
    return written


def stale_configs(root: Path) -> list[Path]:
    """Committed configs that differ from what the generator writes (or are missing)."""
    return [p for p, c in generated_files(root).items() if not p.exists() or p.read_text() != render(c)]
