#!/usr/bin/env bash
# ZeRO-3 + optimizer offload on the 8B shape on 2 x H200 (Llama-3-8B shape, random weights, seq
# 4096, bf16, Liger, no checkpointing). The config is recipe 8b's ds_config with `hf-zero3 config new --like ...
# --offload-optimizer cpu` (pinned host buffers, DeepSpeedCPUAdam); the batch is what `hf-zero3 plan --model 8b
# --hardware h200x2 --liger --global-batch 96` picks for that option: micro 6 x accumulation 8 (planned 147.8 GB per
# GPU of 150.3), then micro 4 x accumulation 12 if the first runs out of memory. Same global batch (96 x 4096 tokens
# = 393k tokens per step): the optimizer step's fixed cost (CPU Adam over 4B parameters per rank, gradients to the
# host and parameters back) is spread over 48 micro batches of compute.
# Numerics: DeepSpeedCPUAdam runs the same AdamW update in fp32 on fp32 master weights as the GPU optimizer does;
# only where it runs changes (and the order of floating-point operations, hence the last bits).
# Usage, from the repository root: bash benchmarks/gpu_offload_8b.sh OUT_DIR   (about 4 minutes; BUDGET_S=230)
# On CPU the script gets as far as the bench's first run (the recipe's bf16 needs a GPU): BATCHES=1x2 checks that.
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
out=${1:?OUT_DIR}
recipe=outputs/recipes/8b-offload-optimizer
mkdir -p "$out"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / ${GPUS:-2} ))}  # CPU Adam: the node's cores shared by the ranks
llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape, random weights
scratch_dir "$recipe" || exit 2
cp -r recipes/8b/. "$recipe/"
python3 -m hf_zero3 config new --like recipes/8b/ds_config.json --offload-optimizer cpu -o "$recipe/ds_config.json" \
  --force > "$out/config_new.txt" 2>&1 || { cat "$out/config_new.txt"; exit 1; }
cp "$recipe/ds_config.json" "$out/ds_config.json"
start=$SECONDS
for batch in ${BATCHES:-6x8 4x12}; do
  micro=${batch%x*} accum=${batch#*x}
  left=$(( ${BUDGET_S:-230} - (SECONDS - start) ))
  [ "$left" -gt 60 ] || { echo "micro $micro x $accum: skipped, budget spent" | tee -a "$out/runs.txt"; break; }
  timeout "$left" python3 -m hf_zero3 bench "$recipe" --label "llama3-8b-offload-opt-m$micro" --suffix offload \
    --steps 2 --warmup 1 --against "" --gpus "${GPUS:-2}" --out "$out" --work-dir "outputs/bench-offload-8b-m$micro" -- \
    --model_name_or_path null --config_name outputs/llama3-8b --tokenizer_name assets/tiny/model \
    --train_file assets/tiny/corpus/train.txt --per_device_train_batch_size "$micro" \
    --gradient_accumulation_steps "$accum" ${TRAIN_OVERRIDES:-} > "$out/bench_m$micro.log" 2>&1
  code=$?
  echo "micro $micro x $accum: exit $code after $(( SECONDS - start )) s" | tee -a "$out/runs.txt"
  cp outputs/bench-offload-8b-m$micro/*.log "$out/" 2>/dev/null
  grep -q "out of memory\|OutOfMemory" "$out/bench_m$micro.log" outputs/bench-offload-8b-m$micro/*.log 2>/dev/null || break
done
free -g >> "$out/runs.txt"
