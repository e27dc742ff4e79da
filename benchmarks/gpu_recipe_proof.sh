#!/usr/bin/env bash
# A recipe proven on the GPUs at hand: benchmarks/recipe_proof.py (the planner's configuration for this hardware, or
# the recipe's own ds_config with --as-shipped; a Llama-2-shaped model with random weights, layer-scaled with
# --layers; `hf-zero3 bench` against the baselines named; this node's host RAM sampled meanwhile), written against
# the planner's prediction to OUT/<tag>_proof.json beside the bench's report.
# Usage, from the repository root:  bash benchmarks/gpu_recipe_proof.sh OUT [recipe_proof.py arguments]
#   7b on one H200, planner's choice against stock tuned by hand both ways, 3 runs each, interleaved:
#     bash benchmarks/gpu_recipe_proof.sh OUT --recipe 7b --gpus 1 --global-batch 16 --steps 5 --warmup 2 \
#       --run-timeout 140 --repeats 3 --against stock_tuned --tuned stock_tuned=1 --tuned stock_tuned=8+ckpt
#   13b on 2 x H200 against stock ZeRO-3 and FSDP2 with checkpointing at micro 4 (nothing fits 13B without it):
#     bash benchmarks/gpu_recipe_proof.sh OUT --recipe 13b --gpus 2 --global-batch 24 --steps 4 --warmup 1 \
#       --repeats 3 --against stock_tuned,fsdp2_tuned --tuned stock_tuned=4+ckpt --tuned fsdp2_tuned=4+ckpt
#   70b at its exact width with L layers, as shipped in v1 (optimizer states in host RAM):
#     bash benchmarks/gpu_recipe_proof.sh OUT --recipe 70b --gpus 2 --layers L --as-shipped \
#       --spec zero3_offload_optimizer --accum 2 --steps 4 --warmup 1 --breakdown --run-timeout 140
#   10b-h200x1 as shipped against whole-parameter persistence and DeepSpeed's SuperOffload (the CPU Adam step
#   overlapped with backward; NVIDIA GPUs only), 3 runs each (about 2.5 min a run, ~23 min in all):
#     bash benchmarks/gpu_recipe_proof.sh OUT --recipe 10b-h200x1 --gpus 1 --as-shipped --steps 4 --warmup 1 \
#       --repeats 3 --run-timeout 240 --breakdown \
#       --variant "persist=zero_optimization.stage3_param_persistence_threshold=9223372036854775807" \
#       --variant "superoffload=zero_optimization.offload_optimizer.super_offload=true"
# Each call stops itself BUDGET_S (default 540) seconds in, keeping every finished run; the same command again
# continues (--resume: same WORK, default outputs/proof, on the same machine). GPU_MEM (default 141GiB, an H200) and
# HOST_RAM (default: this node's MemTotal) are what the planner is asked about. On CPU add --cpu (plumbing only).
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up
out=${1:?usage: bash benchmarks/gpu_recipe_proof.sh OUT [recipe_proof.py arguments]}
shift
work=${WORK:-outputs/proof}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
host_ram=${HOST_RAM:-$(awk '/MemTotal/ {printf "%dKiB", $2}' /proc/meminfo)}
timeout -s TERM "${BUDGET_S:-540}" python3 benchmarks/recipe_proof.py --out "$out" --work "$work" \
  --host-ram "$host_ram" --gpu-mem "${GPU_MEM:-141GiB}" --resume "$@" 2>&1 | tee -a "$out/proof.log"
rc=${PIPESTATUS[0]}
for state in "$work"/*/runs/bench_state.json; do  # what --resume continues from, kept with the results
  [ -f "$state" ] && cp "$state" "$out/$(basename "$(dirname "$(dirname "$state")")")_bench_state.json"
done
exit "$rc"
