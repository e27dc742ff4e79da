#!/usr/bin/env bash
# Where one optimizer step of ours goes, on one H200: the planner's one-GPU choice for the Llama-2-7B shape (random
# weights), sequence 4096, 16 sequences per step (what benchmarks/gpu_speed_7b.sh measures as "ours"), 3 steps, the
# PROFILE_STEP-th under torch.profiler (benchmarks/step_profile.py). Writes OUT/profile_7b<_NAME>.txt: the step's
# wall time, GPU time by category (matmul, attention, collectives, optimizer step, loss, norms/activations/
# elementwise, copies), GPU idle within the step, host syncs, the top kernels; and OUT/profile_7b<_NAME>.log.
# Usage, from the repository root:  bash benchmarks/gpu_profile_7b.sh OUT      (about 3 minutes)
# Settings (environment):
#   NAME          a label for the files (default: none)
#   EXTRA         train overrides on top of ours, e.g. EXTRA="--regional_compile true" (NAME=rc) to profile a lever
#   PROFILE_STEP  which optimizer step (default 3: after the first step's allocations and any compilation)
#   TRACE=1       also OUT/trace_7b<_NAME>.json.gz, the Chrome trace (tens of MB for a 7B step)
#   TIMEOUT_S     the run's limit (default 480)
#   DRY=1         the same on this machine's CPU with the tiny model (the table is over CPU operators): plumbing only
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_profile_7b.sh OUT   (settings: see the header)}
source benchmarks/common.sh || exit 1  # GPU box set-up
work=${WORK:-/tmp/hfz-profile-7b}
name=${NAME:+_$NAME}
mkdir -p "$out"
if [ "${DRY:-0}" = 1 ]; then
  shape=(--recipe tiny --cpu --seq-len 128 --global-batch 4) cpu=(--use_cpu true --bf16 false)
else
  shape=(--recipe 7b --seq-len 4096 --global-batch 16) cpu=()
fi
host_ram=${HOST_RAM:-$(awk '/MemTotal/ {printf "%dKiB", $2}' /proc/meminfo)}
prepared=$(python3 benchmarks/recipe_proof.py "${shape[@]}" --gpus 1 --gpu-mem "${GPU_MEM:-141GiB}" \
  --host-ram "$host_ram" --tag profile --out "$out" --work "$work" --prepare-only | tail -1) || exit 1
echo "$prepared" > "$out/profile_7b${name}_plan.json"
recipe=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["recipe"])' "$prepared")
model=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["model"])' "$prepared")
seq=$([ "${DRY:-0}" = 1 ] && echo 128 || echo 4096)
trace=()
[ "${TRACE:-0}" = 1 ] && trace=(--profile-trace "$out/trace_7b${name}.json.gz")
port=$(python3 -c 'from hf_zero3.job.distributed import free_port; print(free_port())')
timeout -s TERM -k 30 "${TIMEOUT_S:-480}" deepspeed --num_gpus 1 --master_port "$port" benchmarks/step_profile.py \
  --profile-out "$out/profile_7b${name}.txt" --profile-step "${PROFILE_STEP:-3}" "${trace[@]}" \
  "$recipe/train_args.yaml" --deepspeed "$recipe/ds_config.json" --model_name_or_path null --config_name "$model" \
  --tokenizer_name assets/tiny/model --train_file assets/tiny/corpus/train.txt --block_size "$seq" \
  --max_steps "$(( ${PROFILE_STEP:-3} ))" --logging_steps 1 --save_strategy no --eval_strategy no \
  --validation_file null --report_to none --output_dir "$work/run" --overwrite_output_dir true \
  --save_final_model false "${cpu[@]}" ${EXTRA:-} > "$out/profile_7b${name}.log" 2>&1
rc=$?
if [ -f "$out/profile_7b${name}.txt" ]; then cat "$out/profile_7b${name}.txt"; else tail -30 "$out/profile_7b${name}.log"; fi
exit "$rc"
