#!/usr/bin/env bash
# Memory probes behind the planner's calibration (benchmarks/README.md): the 8b workload (Llama-3-8B shape,
# random weights, seq 4096, micro batch 1 x accumulation 4) on 2 GPUs, 3 steps per variant, each run under
# benchmarks/memory_probe.py. Run from the repository root on a 2-GPU box.
# Usage: [PROBE_TAR=results.tgz] bash benchmarks/gpu_memory_probe.sh OUT_DIR VARIANT...
#   VARIANT: zero2, zero2_ckpt, zero3, zero3_ckpt, zero3_offload_opt, zero3_offload_all; and, to check the
#   planner outside the shapes it was calibrated on: zero3_seq6144 (block 6144), zero3_ckpt_micro2 (micro 2 x 2)
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
out=$1; shift
mkdir -p "$out"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / 2 ))}  # CPU Adam: half the cores per rank
llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape, random weights
for variant in "$@"; do
  ckpt=false block=4096 micro=1 accum=4
  case $variant in
    zero2) config=ds_configs/zero2.json ;;
    zero2_ckpt) config=ds_configs/zero2.json; ckpt=true ;;
    zero3) config=recipes/8b/ds_config.json ;;
    zero3_ckpt) config=recipes/8b/ds_config.json; ckpt=true ;;
    zero3_offload_opt) config=ds_configs/zero3_offload_optimizer.json ;;
    zero3_offload_all) config=ds_configs/zero3_offload_all.json ;;
    zero3_seq6144) config=recipes/8b/ds_config.json; block=6144; accum=2 ;;
    zero3_ckpt_micro2) config=recipes/8b/ds_config.json; ckpt=true; micro=2; accum=2 ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  start=$(date +%s)
  deepspeed --num_gpus 2 benchmarks/memory_probe.py --probe_out "$out/$variant" recipes/8b/train_args.yaml \
    --deepspeed "$config" --gradient_checkpointing $ckpt --max_steps 3 --logging_steps 1 --save_strategy no \
    --report_to none --output_dir "outputs/probe-$variant" --overwrite_output_dir true \
    --model_name_or_path null --config_name outputs/llama3-8b --tokenizer_name assets/tiny/model \
    --train_file assets/tiny/corpus/train.txt --block_size $block --per_device_train_batch_size $micro \
    --gradient_accumulation_steps $accum > "$out/$variant.log" 2>&1
  echo "$variant: exit $? in $(( $(date +%s) - start )) s"
  grep -E "memory_probe:|Error|error:" "$out/$variant.log" | tail -5
  if [ -n "${PROBE_TAR:-}" ]; then tar czf "$PROBE_TAR" -C "$out" .; fi  # one file back per call, even if cut short
done
