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
python3 - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=3).save_pretrained("outputs/llama3-8b")
PY
python3 -m hf_zero3 bench 8b --label llama3-8b --steps 8 --warmup 3 --against stock,fsdp2 --gpus 2 \
  --out "$out" --work-dir outputs/bench-8b -- \
  --model_name_or_path null --config_name outputs/llama3-8b --tokenizer_name assets/tiny/model \
  --train_file assets/tiny/corpus/train.txt --block_size 4096 --per_device_train_batch_size 1 \
  --gradient_accumulation_steps 4
