#!/usr/bin/env bash
# Recipe qwen3-30b-a3b proven layer-scaled on one H200: Qwen3-30B-A3B's exact width (128 experts of 768, top-8,
# hidden 2048, vocab 151,936) with LAYERS (default 6) of its 48 layers, random weights from config. 6 layers (4.36B
# parameters) put about one target GPU's share of the model (30.5B over 8 x H100 80GB: 3.8B) on the one GPU, so the
# memory pressure is the target's: stock ZeRO-3 without offload, which fits 4 layers on 140 GB, plans 103 GB here.
# The recipe's ds_config as shipped (ZeRO-3 + partial optimizer offload 0.3 + checkpointing, micro 2 x 4; the MoE
# blocks made leaf modules at start) against AGAINST (default stock_offload,stock), all with checkpointing at the same
# micro and global batch, REPEATS (default 3) runs each, interleaved:
#   stock_offload  transformers' ZeRO-3 offload template (optimizer and parameters on the CPU): what its docs give
#                  when a model does not fit, the like-for-like baseline on the target
#   stock          transformers' ZeRO-3 template, no offload: its peak says whether it would fit the target's 80 GB
#   stock_tuned    Liger and fused AdamW: Liger 0.8.5 swaps Qwen3-MoE's experts for its fused MoE Triton kernel, and
#                  that run finished no step within 150 s on the first try (RUN_TIMEOUT, default 300: a slow
#                  first compile or a hang; stock_offload steps take seconds)
# Transformers' DeepSpeed defaults make Qwen3MoeSparseMoeBlock a leaf in every stock run: the leaf set by hand.
# Tokens/s, MFU from the active parameters, peak GPU memory against the planner's figure and host RAM sampled meanwhile
# (benchmarks/recipe_proof.py). LAYERS=4 AGAINST=stock is the sitting of benchmarks/results/2026-12-03_moe-proof-*.
# Prediction before the 6-layer run: ours peak allocated within 10% of the plan (79.9 GB per GPU planned in all);
# stock above 80 GB; ours >= 2x stock_offload (part of the optimizer states on the host and no parameters, against
# all of both).
# Usage, from the repository root: bash benchmarks/gpu_moe_proof.sh OUT   (a call stops itself at BUDGET_S, default
# 540 s, keeping finished runs; the same command again on the same machine continues: about two calls; the runs' own
# logs are under outputs/proof/qwen3-30b-a3b-<L>L/runs/: copy them to OUT with the results)
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_moe_proof.sh OUT}
against=${AGAINST:-stock_offload,stock}
tuned=()
[[ ",$against," == *,stock_tuned,* ]] && tuned=(--tuned stock_tuned=2+ckpt)  # the recipe's micro batch, checkpointing
exec bash benchmarks/gpu_recipe_proof.sh "$out" --recipe qwen3-30b-a3b --gpus 1 --layers "${LAYERS:-6}" --as-shipped \
  --steps 5 --warmup 2 --repeats "${REPEATS:-3}" --against "$against" "${tuned[@]}" \
  --run-timeout "${RUN_TIMEOUT:-300}"
