#!/usr/bin/env bash
# ZeRO options on the 8b recipe's workload (2 GPUs, Llama-3-8B shape, random weights): each variant is
# the recipe with one ds_config change, benchmarked alone with `hf-zero3 bench`. Run from the repo root.
# Usage: bash benchmarks/gpu_sweep_8b.sh [OUT_DIR]
set -euo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
out=${1:-benchmarks}
llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape, random weights
for variant in zero3_big_buckets zero2; do
  recipe=outputs/recipes/8b-$variant
  scratch_dir "$recipe" && cp -r recipes/8b/. "$recipe"
  python3 - "$recipe/ds_config.json" "$variant" <<'PY'
import json, sys
path, variant = sys.argv[1], sys.argv[2]
config = json.load(open(path))
zero = config["zero_optimization"]
if variant == "zero3_big_buckets":  # fewer, larger all-gathers and reduce-scatters; norms/biases stay whole
    zero.update(reduce_bucket_size=500_000_000, stage3_prefetch_bucket_size=500_000_000,
                stage3_param_persistence_threshold=1_000_000, stage3_max_live_parameters=3_000_000_000)
if variant == "zero2":  # what `hf-zero3 plan --model 8b --gpus 2 --gpu-mem 141GB` picks for micro batch 1
    config["zero_optimization"] = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                   "reduce_bucket_size": "auto", "allgather_bucket_size": 500_000_000}
json.dump(config, open(path, "w"), indent=2)
PY
  python3 -m hf_zero3 bench "$recipe" --label "llama3-8b-$variant" --steps 8 --warmup 3 --against "" --gpus 2 \
    --out "$out" --work-dir "outputs/bench-$variant" -- \
    --model_name_or_path null --config_name outputs/llama3-8b --tokenizer_name assets/tiny/model \
    --train_file assets/tiny/corpus/train.txt --block_size 4096 --per_device_train_batch_size 1 \
    --gradient_accumulation_steps 4 || true
done
