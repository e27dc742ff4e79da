#!/usr/bin/env bash
# Recipe qwen3-30b-a3b proven layer-scaled on one H200: Qwen3-30B-A3B's exact width (128 experts of 768, top-8,
# hidden 2048, vocab 151,936) with LAYERS (default 4) of its 48 layers: 3.11B parameters, random weights from config.
# The recipe's ds_config as shipped (ZeRO-3 + partial optimizer offload 0.3 + checkpointing, micro 2 x 4; the MoE
# blocks made leaf modules at start) against stock ZeRO-3 (`stock`: transformers' template, whose DeepSpeed defaults
# make Qwen3MoeSparseMoeBlock a leaf: the leaf set by hand) with checkpointing at the same micro batch and global
# batch, REPEATS (default 3) runs each, interleaved. AGAINST=stock_tuned,stock adds the tuned stock run (Liger and
# fused AdamW): Liger 0.8.5 swaps Qwen3-MoE's experts for its fused MoE Triton kernel, and that run finished no step
# within 150 s on the first try (RUN_TIMEOUT, default 150; 300 tells a slow first compile from a hang); tokens/s, MFU from the active parameters, peak GPU memory against the
# planner's figure and host RAM sampled meanwhile (benchmarks/recipe_proof.py).
# Prediction before any run: peak allocated within 10% of the plan; ours >= stock (same config family, Liger on
# ours); MFU low (the experts' weights are gathered for an eighth of their work per token).
# Usage, from the repository root: bash benchmarks/gpu_moe_proof.sh OUT   (about 7 minutes on one H200; the runs'
# own logs are under outputs/proof/qwen3-30b-a3b-<L>L/runs/: copy them to OUT with the results)
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_moe_proof.sh OUT}
against=${AGAINST:-stock}
tuned=()
[[ ",$against," == *,stock_tuned,* ]] && tuned=(--tuned stock_tuned=2+ckpt)  # the recipe's micro batch, checkpointing
exec bash benchmarks/gpu_recipe_proof.sh "$out" --recipe qwen3-30b-a3b --gpus 1 --layers "${LAYERS:-4}" --as-shipped \
  --steps 5 --warmup 2 --repeats "${REPEATS:-3}" --against "$against" "${tuned[@]}" \
  --run-timeout "${RUN_TIMEOUT:-150}"
