#!/usr/bin/env bash
# Issue 14: the recipes proven on 2 x H200 (run from the repository root on the GPU box; Llama-2 shapes with random
# weights, seq 4096, bf16). Each proof runs benchmarks/recipe_proof.py: `hf-zero3 bench` of the configuration plus
# this node's host RAM, written against the planner's prediction to OUT/<name>_proof.json.
#   PART=a  7b on 1 GPU (AGAINST_7B=stock adds the stock template at the same batch, issue 13 item 5;
#           AGAINST_7B=stock,stock_tuned TUNED_7B=stock_tuned=1 adds stock without checkpointing at micro 1) and 13b on
#           2 GPUs, each with the planner's choice for that hardware, 20 measured steps
#           (~5 min incl. start-up)
#   PART=b  70b layer-scaled: recipe 70b v1's ds_config (ZeRO-3 + optimizer states in host RAM + checkpointing; v2
#           moved them to NVMe, proven apart by gpu_offload_70b_width.sh) at Llama-2-70B's width with LAYERS (default
#           2 8 4) layers on 2 GPUs, micro 1 x accumulation 2, 4 measured steps (~100 s each); a layer count is
#           skipped once BUDGET_S seconds have passed since the start
# Usage: PART=a|b|ab bash benchmarks/gpu_recipes_proof.sh OUT_DIR [WORK_DIR]
set -uo pipefail
if [ -f .whl/install.sh ]; then source .whl/install.sh; fi  # DeepSpeed, Liger, ... on the GPU box
export TORCH_CUDA_ARCH_LIST=9.0
out=${1:?OUT_DIR}
work=${2:-outputs/proof}
part=${PART:-ab}
host_ram=$(awk '/MemTotal/ {printf "%dKiB", $2}' /proc/meminfo)
proof() { timeout "$1" python3 benchmarks/recipe_proof.py --out "$out" --work "$work" --host-ram "$host_ram" \
            --gpu-mem 141GiB "${@:2}" > "$out/${PROOF_NAME}.log" 2>&1; echo "$PROOF_NAME exit $?" | tee -a "$out/proofs.txt"; }
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
if [[ $part == *a* ]]; then
  n7=$(( 1 + $(echo "${AGAINST_7B:-}" | tr ',' '\n' | grep -c .) ))  # runs in the 7b proof: ours + each baseline
  PROOF_NAME=7b proof $(( n7 * 150 )) --recipe 7b --gpus 1 --steps 20 --warmup 3 --run-timeout 140 ${AGAINST_7B:+--against $AGAINST_7B} ${TUNED_7B:+--tuned $TUNED_7B}
  PROOF_NAME=13b proof 240 --recipe 13b --gpus 2 --steps 20 --warmup 2 --run-timeout 230
fi
if [[ $part == *b* ]]; then
  for layers in ${LAYERS:-2 8 4}; do
    [ $(( $(date +%s) - start )) -lt ${BUDGET_S:-100000} ] || { echo "70b-${layers}L skipped: budget" | tee -a "$out/proofs.txt"; continue; }
    PROOF_NAME=70b-${layers}L proof 150 --recipe 70b --gpus 2 --layers "$layers" --as-shipped --spec zero3_offload_optimizer --accum 2 \
      --steps 4 --warmup 1 --breakdown --run-timeout 140
  done
fi
