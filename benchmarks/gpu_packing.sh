#!/usr/bin/env bash
# Packed against padded chat batches, Llama-2-7B shape, one GPU, ZeRO-3 (ds_configs/zero3.json), bf16, full
# activation checkpointing, one epoch over the same long-tailed conversations (benchmarks/packing_bench.py).
# Each run is the product's own path: `torchrun -m hf_zero3.train` on a YAML, `packing` true or false.
# Usage, from the repository root:  VARIANTS="packed:sdpa:2:1 padded:sdpa:8:2" REPEATS=3 bash benchmarks/gpu_packing.sh OUT
# A variant is layout:attention:micro:accumulation; a packed row holds ~8 of these conversations, so packed 2 x 1
# and padded 8 x 2 take about the same examples per optimizer step (and the same number of steps). The same WORK again reuses the prepared data; runs are numbered on.
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
out=${1:?OUT_DIR}
work=${WORK:-/tmp/packing-bench}
mkdir -p "$out" "$work/runs"
# Stopped from outside (a timeout around this script): stop the run in flight too, or it keeps the GPU.
trap '[ -n "${child:-}" ] && kill -TERM "$child" && wait "$child"; exit 143' TERM INT
[ -f "$work/lengths.json" ] || python3 benchmarks/packing_bench.py prepare --work "$work" --examples "${EXAMPLES:-400}" \
  2>&1 | tee -a "$out/packing.log"
for repeat in $(seq 1 "${REPEATS:-1}"); do
  for variant in ${VARIANTS:-packed:sdpa:2:1 padded:sdpa:8:2}; do
    IFS=: read -r layout attention micro accum <<<"$variant"
    n=$(ls "$work/runs" | wc -l)
    run="$work/runs/$(printf %02d "$n")_${layout}_${attention}_m${micro}x${accum:-1}"
    mkdir -p "$run"
    packing=$([ "$layout" = packed ] && echo true || echo false)
    echo "{\"packing\": $packing, \"attention\": \"$attention\", \"micro\": $micro, \"accumulation\": ${accum:-1}, \"repeat\": $repeat}" > "$run/variant.json"
    cat > "$run/run.yaml" <<YAML
config_name: $work/llama2-7b-shape
tokenizer_name: $work/llama2-7b-shape
train_file: $work/train.jsonl
validation_file: $work/validation.jsonl
block_size: 4096
packing: $packing
deepspeed: $PWD/ds_configs/zero3.json
output_dir: $run/out
bf16: true
per_device_train_batch_size: $micro
per_device_eval_batch_size: $micro
gradient_accumulation_steps: ${accum:-1}
eval_on_start: true
gradient_checkpointing: true
attn_implementation: $attention
learning_rate: 1.0e-5
lr_scheduler_type: constant
max_grad_norm: 1.0
num_train_epochs: 1
logging_steps: 1
save_strategy: "no"
save_final_model: false
seed: 42
report_to: none
YAML
    echo "== $(date +%T) $run" | tee -a "$out/packing.log"
    timeout "${RUN_TIMEOUT:-300}" torchrun --nproc_per_node 1 -m hf_zero3.train "$run/run.yaml" \
      > "$run/stdout.log" 2>&1 &
    child=$!
    wait "$child"
    echo "rc $? $(grep -c step_time_s "$run/out/train_log.jsonl" 2>/dev/null) steps" | tee -a "$out/packing.log"
    cp "$run/out/train_log.jsonl" "$run/train_log.jsonl" 2>/dev/null || tail -30 "$run/stdout.log" >> "$out/packing.log"
    python3 benchmarks/packing_bench.py report --work "$work" --out "$out/packing.md" > /dev/null 2>&1
    tar -C "$work" --exclude=out -czf "$out/runs.tgz" runs lengths.json
  done
done
python3 benchmarks/packing_bench.py report --work "$work" --out "$out/packing.md"
