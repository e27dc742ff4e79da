#!/usr/bin/env bash
# The same-lease comparison behind benchmarks/llama3-8b_2xH200_<date>_tuned.md, run from the repository root on a
# 2-GPU box: a Llama-3-8B-shaped model with random weights (no download), recipe 8b as shipped ("ours") and the
# candidate ZeRO-2 + Liger recipe ("zero2_liger": ds_configs/zero2.json, micro 2 x accumulation 3) against the
# hand-tuned stock baselines (stock_tuned ZeRO-3, zero2_tuned, fsdp2_tuned: hf_zero3/bench.py), same global batch
# (12 x 4096 tokens), 3 runs each, interleaved. A call cut short is continued with --resume (same WORK_DIR).
# Usage: bash benchmarks/gpu_tuned_8b.sh [OUT_DIR [WORK_DIR [--resume]]]
set -euo pipefail
out=${1:-benchmarks}
work=${2:-outputs/bench-8b-tuned}
shift $(( $# < 2 ? $# : 2 ))
arch=${TORCH_CUDA_ARCH_LIST:-}
if [ -n "$arch" ]; then export TORCH_CUDA_ARCH_LIST="${arch//9.0a/9.0}"; fi
[ -f outputs/llama3-8b/config.json ] || python3 - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=3).save_pretrained("outputs/llama3-8b")
PY
python3 - <<'PY'
# The ZeRO-2 candidate: recipe 8b with the generator's ZeRO-2 config and micro 2 x accumulation 3 (same global batch).
import shutil
from pathlib import Path

from hf_zero3.ds_config import build_ds_config
from hf_zero3.presets import STANDALONE_CONFIGS, render

folder = Path("outputs/recipes/8b-zero2-liger")
shutil.rmtree(folder, ignore_errors=True)
shutil.copytree("recipes/8b", folder)
(folder / "ds_config.json").write_text(render(build_ds_config(STANDALONE_CONFIGS["zero2"])))
text = (folder / "train_args.yaml").read_text()
text = text.replace("per_device_train_batch_size: 3\n", "per_device_train_batch_size: 2\n")
text = text.replace("gradient_accumulation_steps: 2\n", "gradient_accumulation_steps: 3\n")
assert "per_device_train_batch_size: 2\n" in text and "gradient_accumulation_steps: 3\n" in text
assert "use_liger_kernel: true\n" in text
(folder / "train_args.yaml").write_text(text)
PY
python3 -m hf_zero3 bench 8b --label llama3-8b --steps 4 --warmup 1 --repeats 3 --run-timeout 240 \
  --against stock_tuned,zero2_tuned,fsdp2_tuned --variant zero2_liger=outputs/recipes/8b-zero2-liger --gpus 2 \
  --out "$out" --work-dir "$work" "$@" -- \
  --model_name_or_path null --config_name outputs/llama3-8b --tokenizer_name assets/tiny/model \
  --train_file assets/tiny/corpus/train.txt
