#!/usr/bin/env bash
# LoRA under ZeRO-3 on the Llama-3-8B shape (random weights, no download), 1 x H200, sequence 4096, global batch 16
# sequences (65,536 tokens per step), 6 steps, medians after 2 warm-up steps (benchmarks/lora_bench.py):
#   lora        hf_zero3 train with peft: {r: 16, alpha: 32, dropout: 0.05, all-linear}, the planner's choice
#               (`hf-zero3 plan --model 8b --hardware h200x1 --global-batch 16 --lora-rank 16`: ZeRO-2, micro 4 x 4,
#               no checkpointing, Liger when installed; 120.0 GB planned)
#   lora_zero3  the same on the planner's best ZeRO-3 option; saves once at the last step: the checkpoint's adapter
#               verified on the GPU, then exported (hf-zero3 export)
#   full        every weight trains, the planner's choice (ZeRO-3 + CPU offload of the optimizer at ratio 0.2 +
#               checkpointing, micro 4 x 4; 145.4 GB planned)
#   stock_peft  stock Trainer + transformers' ZeRO-3 template + get_peft_model by hand, checkpointing, micro 4 x 4
#   stock_peft_nockpt  the same without checkpointing (a user tries both)
# Prediction, written before any run: lora 9,000-13,000 tokens/s/GPU (backward without weight gradients: ~4N instead
# of 6N FLOPs per token), peak allocated within 10% of the plan; lora_zero3 within 10% of lora (one GPU: ZeRO-3's gathers
# are views); full 2,500-5,000 (offload + recompute); stock_peft 0.6-0.85x lora (recompute, "auto" persistence on one
# GPU), stock_peft_nockpt 0.8-1.0x lora. The 16 GB of random weights are written first (~1 min).
# Time: start-up ~60 s per run (8B from disk) + 6 steps; lora ~2 min, full ~4 min. One call stops itself BUDGET_S
# (default 560) seconds in; the same command again continues (a variant with its OUT/<variant>.json is not run again).
# Two calls, e.g.: VARIANTS=lora,lora_zero3,stock_peft bash benchmarks/gpu_lora_8b.sh OUT, then
# VARIANTS=stock_peft_nockpt,full bash benchmarks/gpu_lora_8b.sh OUT (the report lists the variants of that call; the
# last call with VARIANTS unset writes the table of all five from their JSON files without running any again)
# Usage, from the repository root: bash benchmarks/gpu_lora_8b.sh OUT_DIR [more lora_bench.py options]
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, llama3_8b_config
out=${1:?OUT_DIR}
mkdir -p "$out"
llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape
timeout -s TERM "${BUDGET_S:-560}" python3 benchmarks/lora_bench.py --out "$out" --model-config outputs/llama3-8b \
  --weights "${WEIGHTS:-outputs/llama3-8b-weights}" --variants "${VARIANTS:-lora,lora_zero3,stock_peft,stock_peft_nockpt,full}" \
  --global-batch 16 --steps 6 --warmup 2 "${@:2}" 2>&1 | tee -a "$out/lora_bench.log"
exit "${PIPESTATUS[0]}"
