#!/usr/bin/env bash
# Issue 13, item 5, with repeats: the 7b on one H200 at global batch 16, the planner's choice against stock HF ZeRO-3
# tuned by hand both ways, REPEATS runs of each, interleaved, in one lease:
#   ours                 the planner's choice (`hf-zero3 plan --model 7b --hardware h200x1 --global-batch 16 --liger`):
#                        ZeRO-3, checkpointing on the first 9 of 32 layers, micro 2 x 8, every parameter persistent,
#                        5e8 buckets, Liger
#   stock_tuned_1        stock template, Trainer's fused AdamW, no checkpointing, micro 1 x 16 (the largest without)
#   stock_tuned_8_ckpt   the same with checkpointing at micro 8 x 2 (the best stock in the last two leases)
# Prediction, written before any run of it (benchmarks/results/2026-12-01_partial-ckpt-7b-1gpu/report.md: 8 layers 11,680,
# 12 layers 11,289, stock 8+ckpt 8,284): ours 11,200-11,900 tokens/s/GPU, 1.35-1.43x the best stock; stock_tuned_1
# 0.72-0.80x stock_tuned_8_ckpt.
# Time: a run ~90-100 s (start-up ~45 s + 7 steps of 6.5-8 s): one repeat of the three ~5 min. Each call stops itself
# BUDGET_S (default 540) seconds in; the same command again continues (--resume, same WORK, warm machine).
# Usage, from the repository root: REPEATS=3 bash benchmarks/gpu_7b_1gpu_vs_tuned.sh OUT_DIR
set -uo pipefail
if [ -f .whl/install.sh ]; then source .whl/install.sh; fi
export TORCH_CUDA_ARCH_LIST=9.0
out=${1:?OUT_DIR}
work=${WORK:-/tmp/p7-vs-tuned}
mkdir -p "$out"
host_ram=$(awk '/MemTotal/ {printf "%dKiB", $2}' /proc/meminfo)
timeout -s TERM "${BUDGET_S:-540}" python3 benchmarks/recipe_proof.py --out "$out" --work "$work" \
  --host-ram "$host_ram" --gpu-mem 141GiB --recipe 7b --gpus 1 --global-batch 16 --steps 5 --warmup 2 \
  --run-timeout 140 --repeats "${REPEATS:-3}" --against stock_tuned --tuned stock_tuned=1 \
  --tuned stock_tuned=8+ckpt --tag 7b-gb16-vs-tuned --resume 2>&1 | tee -a "$out/proof.log"
rc=${PIPESTATUS[0]}
cp "$work"/7b-gb16-vs-tuned/runs/bench_state.json "$out/" 2>/dev/null
exit "$rc"
