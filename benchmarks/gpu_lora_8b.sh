#!/usr/bin/env bash
# LoRA under ZeRO-3 on the Llama-3-8B shape (random weights, no download), 1 x H200, sequence 4096, global batch 16
# sequences (65,536 tokens per step), 6 steps, medians after 2 warm-up steps (benchmarks/lora_bench.py); every
# variant's schedule: linear decay from 1e-4, no warmup:
#   lora        hf_zero3 train with peft: {r: 16, alpha: 32, dropout: 0.05, all-linear}, the planner's choice
#               (`hf-zero3 plan --model 8b --hardware h200x1 --global-batch 16 --lora-rank 16`: ZeRO-2, micro 4 x 4,
#               no checkpointing, Liger when installed; 135.8 GB planned, 121.3 GiB allocated; measured 119.6 GiB,
#               13,223 tokens/s, benchmarks/results/2026-12-03_lora-8b-h200)
#   lora_zero3  the same on the planner's best ZeRO-3 option (micro 4 x 4, every parameter persistent; 137.9 GB
#               planned, 123.2 GiB allocated: ZeRO-3's own linear drops frozen layers' inputs and the adapter is bf16,
#               so a layer keeps what it keeps at ZeRO-2; before those, micro 4 ran out of memory and micro 2 x 8 ran);
#               saves once at the last step: the checkpoint's adapter verified on the GPU, then exported
#   full        every weight trains, the planner's choice (ZeRO-3 + CPU offload of the optimizer at ratio 0.2 +
#               checkpointing, micro 4 x 4; 145.4 GB planned)
#   stock_peft  stock Trainer + transformers' ZeRO-3 template + get_peft_model by hand, checkpointing, micro 4 x 4;
#               the template's WarmupLR block removed, so the Trainer's schedule (the same as ours) applies
#   stock_peft_nockpt  the same without checkpointing (a user tries both), from lora_zero3's micro batch, stepping
#               down on out-of-memory as a user would (stock keeps every frozen layer's input and an fp32 adapter:
#               it ran at micro 2 x 8, 98.1 GiB, in the re-run)
#   plain_peft  the stock script on the plain Trainer without DeepSpeed (one GPU), no checkpointing, micro 4 x 4
# Prediction, written before any run: lora 9,000-13,000 tokens/s/GPU (backward without weight gradients: ~4N instead
# of 6N FLOPs per token), peak allocated within 10% of the plan; lora_zero3 within 10% of lora (one GPU: ZeRO-3's gathers
# are views); full 2,500-5,000 (offload + recompute); stock_peft 0.6-0.85x lora (recompute, "auto" persistence on one
# GPU), stock_peft_nockpt 0.8-1.0x lora; plain_peft (added later, before its first run) 0.95-1.05x lora (one GPU:
# ZeRO-2's reduction is a copy). Prediction for the re-run (after the first): lora_zero3 peak allocated
# 95-101 GiB (planned 100.5; the plan may only be above), stock_peft_nockpt about the same memory at micro 2.
# Prediction for lora_zero3 at micro 4 with ZeRO-3's own linear and the bf16 adapter (written before its first run):
# peak allocated 118-123.2 GiB (the plan may only be above), 0.9-1.0x lora's tokens/s (it was 0.52x at micro 2).
# The 16 GB of random weights are written first (~1 min).
# Time: start-up ~80 s per run (8B from disk) + 6 steps; lora ~2 min, full ~4 min. One call stops itself BUDGET_S
# (default 560) seconds in; the same command again continues (a variant with its OUT/<variant>.json is not run again).
# The re-run of the first run's failures, from an empty OUT:
#   VARIANTS=lora_zero3,stock_peft,stock_peft_nockpt bash benchmarks/gpu_lora_8b.sh OUT
# then, for the whole table in one sitting: VARIANTS=lora,full bash benchmarks/gpu_lora_8b.sh OUT, and last
# `bash benchmarks/gpu_lora_8b.sh OUT` with VARIANTS unset (it writes the table of all five from their JSON files
# without running any again; the report lists the variants of each call)
# REPEATS=3 runs each variant 3 times, interleaved (every variant once, then again), for a published ratio: e.g.
#   REPEATS=3 VARIANTS=lora,full,stock_peft BUDGET_S=560 bash benchmarks/gpu_lora_8b.sh OUT   # again until done
# Usage, from the repository root: bash benchmarks/gpu_lora_8b.sh OUT_DIR [more lora_bench.py options]
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, llama3_8b_config
out=${1:?OUT_DIR}
mkdir -p "$out"
llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape
variants=${VARIANTS:-lora,lora_zero3,stock_peft,stock_peft_nockpt,plain_peft,full}
timeout -s TERM "${BUDGET_S:-560}" python3 benchmarks/lora_bench.py --out "$out" --model-config outputs/llama3-8b \
  --weights "${WEIGHTS:-outputs/llama3-8b-weights}" --variants "$variants" \
  --global-batch 16 --steps 6 --warmup 2 --repeats "${REPEATS:-1}" "${@:2}" 2>&1 | tee -a "$out/lora_bench.log"
exit "${PIPESTATUS[0]}"
