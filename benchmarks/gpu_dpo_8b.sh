#!/usr/bin/env bash
# DPO + LoRA r16 on the Llama-3-8B shape, one GPU: `hf-zero3` recipe 8b-dpo (its launch.sh, its ds_config) against
# TRL's own DPO script (trl/scripts/dpo.py, torchrun) given the same ds_config, weights, pairs and settings, as a
# competent user sets it: once with the recipe's switches (no checkpointing, micro 2), once with Liger's fused DPO
# loss added (`--use_liger_kernel`). Random bf16 weights saved to disk first, so both sides load the same folder.
# Usage, from the repository root:  VARIANTS="ours trl trl_liger" MICRO=2 ACCUM=8 bash benchmarks/gpu_dpo_8b.sh OUT
# ours_torchrun: the same run started by torchrun instead of the recipe's DeepSpeed launcher.
# One epoch over PAIRS pairs (default 128 = 8 optimizer steps of micro 2 x accumulation 8).
set -uo pipefail
source benchmarks/common.sh || exit 1
out=${1:?OUT_DIR}; work=${WORK:-/tmp/dpo-bench}; micro=${MICRO:-2}; accum=${ACCUM:-8}
mkdir -p "$out" "$work/runs"
trap '[ -n "${child:-}" ] && kill -TERM "$child" && wait "$child"; exit 143' TERM INT
llama3_8b_config
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git rev-parse HEAD; python3 -c "import torch, transformers, trl, peft, deepspeed, accelerate; print(torch.__version__, transformers.__version__, trl.__version__, peft.__version__, deepspeed.__version__, accelerate.__version__)"; } > "$out/gpu.txt" 2>&1
[ -f "$work/lengths.json" ] || python3 benchmarks/dpo_bench.py prepare --work "$work" --pairs "${PAIRS:-128}" | tee -a "$out/dpo.log"
[ -f "$work/model/config.json" ] || { echo "== $(date +%T) weights" >> "$out/dpo.log"; python3 benchmarks/dpo_bench.py weights --work "$work" >> "$out/dpo.log" 2>&1; }
common="--per_device_train_batch_size $micro --gradient_accumulation_steps $accum --num_train_epochs 1 --logging_steps 1
  --save_strategy no --report_to none --seed 42 --learning_rate 5e-6 --lr_scheduler_type cosine --warmup_steps 1 --bf16 true"
trl_dpo=$(python3 -c 'import os, trl; print(os.path.join(os.path.dirname(trl.__file__), "scripts", "dpo.py"))')
for repeat in $(seq 1 "${REPEATS:-1}"); do
  for variant in ${VARIANTS:-ours trl trl_liger}; do
    run="$work/runs/$(printf %02d "$(ls "$work/runs" | wc -l)")_$variant"; mkdir -p "$run"
    case $variant in
      ours) cmd=(env MODEL="$work/model" bash recipes/8b-dpo/launch.sh --train_file "$work/data/train.jsonl"
                 --output_dir "$run/out" --save_final_model false $common) ;;
      ours_torchrun) cmd=(torchrun --nproc_per_node 1 -m hf_zero3.train recipes/8b-dpo/train_args.yaml
                 --deepspeed recipes/8b-dpo/ds_config.json --model_name_or_path "$work/model"
                 --train_file "$work/data/train.jsonl" --output_dir "$run/out" --save_final_model false $common) ;;
      trl|trl_liger) cmd=(torchrun --nproc_per_node 1 "$trl_dpo" --model_name_or_path "$work/model"
                 --dataset_name "$work/data" --output_dir "$run/out" --deepspeed recipes/8b-dpo/ds_config.json
                 --dtype bfloat16 --attn_implementation sdpa --max_length 2048 --beta 0.1 --loss_type sigmoid
                 --gradient_checkpointing false --use_peft --lora_r 16 --lora_alpha 32 --lora_dropout 0.05
                 --lora_target_modules all-linear $common)
           [ "$variant" = trl_liger ] && cmd+=(--use_liger_kernel true) ;;
    esac
    echo "== $(date +%T) $run: ${cmd[*]}" | tee -a "$out/dpo.log"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$run/gpu_mib.txt" 2>/dev/null &
    sampler=$!
    # Each run compiles its Triton kernels (TRL's chunked log-probs, Liger's) from cold: the first run on a machine
    # would otherwise pay for the compilation every later run reuses.
    TRITON_CACHE_DIR="$run/triton" timeout "${RUN_TIMEOUT:-300}" "${cmd[@]}" > "$run/stdout.log" 2>&1 &
    child=$!; wait "$child"; rc=$?; kill "$sampler" 2>/dev/null
    echo "rc $rc" | tee -a "$out/dpo.log"; [ $rc = 0 ] || tail -25 "$run/stdout.log" >> "$out/dpo.log"
    cp "$run/out/train_log.jsonl" "$run/" 2>/dev/null
    python3 benchmarks/dpo_bench.py report --work "$work" --out "$out/dpo.md" > /dev/null 2>&1
    tar -C "$work" --exclude=out --exclude=triton -czf "$out/runs.tgz" runs lengths.json
  done
done
python3 benchmarks/dpo_bench.py report --work "$work" --out "$out/dpo.md"
