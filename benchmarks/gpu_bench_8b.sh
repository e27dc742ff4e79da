#!/usr/bin/env bash
# The GPU benchmark behind benchmarks/llama3-8b_2xH200_<date>.md, run from the repository root on a
# 2-GPU box: a Llama-3-8B-shaped model with random weights (no download), our 8b recipe against the
# stock HF ZeRO-3 template and FSDP2, same sequence length, global batch and GPUs.
# Usage: bash benchmarks/gpu_bench_8b.sh [OUT_DIR]
set -euo pipefail
out=${1:-benchmarks}
# DeepSpeed's JIT op builder cannot parse arch lists like "9.0a" (set by some CUDA images); FusedAdam needs it.
arch=${TORCH_CUDA_ARCH_LIST:-}
if [ -n "$arch" ]; then export TORCH_CUDA_ARCH_LIST="${arch//9.0a/9.0}"; fi
source benchmarks/llama3_8b_config.sh  # outputs/llama3-8b: the Llama-3-8B shape, random weights
python3 -m hf_zero3 bench 8b --label llama3-8b --steps 8 --warmup 3 --against stock,fsdp2 --gpus 2 \
  --out "$out" --work-dir outputs/bench-8b -- \
  --model_name_or_path null --config_name outputs/llama3-8b --tokenizer_name assets/tiny/model \
  --train_file assets/tiny/corpus/train.txt --block_size 4096 --per_device_train_batch_size 1 \
  --gradient_accumulation_steps 4
