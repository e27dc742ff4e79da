#!/usr/bin/env bash
# The longest sequence a Llama-3-8B-shape full fine-tune trains at on one GPU: the planner's configuration
# (`hf-zero3 plan --seq-len L`: its ds_config and TrainingArguments, tiled compute and activation offload included)
# against stock Hugging Face as a competent user sets it: ZeRO-3 with the least optimizer offload that the planner
# says fits without activation offload (an 8B's optimizer states need partial CPU offload on one GPU), activation
# checkpointing and Liger, no tiling.
# long_seq.md (benchmarks/long_seq_bench.py) tabulates the runs: step time, memory against the plan, and the longest
# length each side trained at.
# The model: Llama-3.1-8B's shape and positions, random weights (MODEL=folder for another config).
# Raw text (the tiny corpus, repeated) in full blocks of L tokens, micro batch 1, STEPS optimizer steps per run.
# Usage, from the repository root:  RUNS="ours:196608 stock:196608" STEPS=3 bash benchmarks/gpu_long_seq_8b.sh OUT
# A run is side:length. Each run sits in its own timeout (RUN_TIMEOUT s); a stock run at a length that does not fit
# ends in an out-of-memory error, which is its result.
# CPU plumbing check: MODEL=assets/tiny/model PLAN_ARGS="--precision fp32" EXTRA="--bf16 false" RUNS="ours:256 stock:256"
set -uo pipefail
source benchmarks/common.sh || exit 1
out=${1:?OUT_DIR}; work=${WORK:-/tmp/long-seq}; steps=${STEPS:-3}
runs=${RUNS:-ours:196608 stock:196608}  # the planned length of both on the single-H200 box
mkdir -p "$out" "$work/runs"
save_runs() {
  cp "${run:-}/out/train_log.jsonl" "${run:-}/" 2>/dev/null; tar -C "$work" --exclude=out -czf "$out/runs.tgz" runs
  python3 benchmarks/long_seq_bench.py report "$work" "$out/long_seq.md" "$steps" > /dev/null
}
# Stopped from outside (a time limit), the run in flight is ended and every run's files so far are kept.
trap '[ -n "${child:-}" ] && kill -TERM "$child" && wait "$child"; kill "${sampler:-}" 2>/dev/null; save_runs; exit 143' TERM INT
llama3_8b_config
# Llama-3.1-8B's positions (131072, its rope scaling) unless MODEL names a config; either way at least the longest
# run's positions, in a copy (block_size is checked against them).
longest=$(for spec in $runs; do echo "${spec#*:}"; done | sort -n | tail -1)
template=${MODEL:+given}; base=${MODEL:-outputs/llama3-8b}; MODEL=$work/$(basename "$base")-$longest
python3 - "$base/config.json" "$MODEL" "$longest" "${template:-llama31}" <<'PY'
import json, os, sys
config = json.load(open(sys.argv[1]))
if sys.argv[4] == "llama31":  # the 8B template: Llama-3.1's rope scaling
    theta = config.pop("rope_parameters", {}).get("rope_theta") or config.pop("rope_theta", 500000.0)
    config.pop("rope_scaling", None)  # transformers 5 reads rope_parameters (a legacy rope_scaling loses rope_theta)
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
config["max_position_embeddings"] = max(131072, config.get("max_position_embeddings", 0), int(sys.argv[3]))
os.makedirs(sys.argv[2], exist_ok=True)
json.dump(config, open(os.path.join(sys.argv[2], "config.json"), "w"), indent=2)
PY
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; free -g; git rev-parse HEAD; python3 -c "import torch, transformers, trl, deepspeed, accelerate, liger_kernel; print(torch.__version__, transformers.__version__, trl.__version__, deepspeed.__version__, accelerate.__version__)"; } > "$out/gpu.txt" 2>&1
# Arguments the planner refuses (exit 2: a hardware profile or flag it does not know) end the script before any run.
first=$(for spec in $runs; do echo "${spec#*:}"; done | head -1)
HF_HUB_OFFLINE=1 python3 -m hf_zero3 plan --model $MODEL --hardware ${HARDWARE:-h200x1} --seq-len "$first" \
  --micro-batch 1 --liger ${PLAN_ARGS:-} --json > /dev/null 2> "$work/plan_check.txt"
[ $? = 2 ] && { tee -a "$out/long.log" < "$work/plan_check.txt"; exit 2; }
[ -f "$work/corpus.txt" ] || for i in 1 2 3; do cat assets/tiny/corpus/train.txt; done > "$work/corpus.txt"
for spec in $runs; do
  IFS=: read -r side length <<<"$spec"
  run="$work/runs/$(printf %02d "$(ls "$work/runs" | wc -l)")_${side}_$length"; mkdir -p "$run"
  HF_HUB_OFFLINE=1 python3 -m hf_zero3 plan --model $MODEL --hardware ${HARDWARE:-h200x1} --seq-len "$length" \
    --micro-batch 1 --liger ${PLAN_ARGS:-} --write-config "$run/ds_config.json" > "$run/plan.txt" 2>&1
  args=$(sed -n 's/^TrainingArguments: //p' "$run/plan.txt")
  if [ "$side" = ours ] && [ ! -f "$run/ds_config.json" ]; then  # the planner's answer is the result
    echo "no plan" > "$run/rc.txt"; grep "nothing fits" "$run/plan.txt" | tee -a "$out/long.log"; save_runs; continue
  fi
  if [ "$side" = stock ]; then
    # Stock's best at this length: the planner's least-offload ZeRO-3 option with checkpointing and no activation
    # offload (benchmarks/long_seq_bench.py stock-config), with the stock HF switches only: checkpointing and Liger.
    args="--gradient_checkpointing true --gradient_checkpointing_kwargs '{\"use_reentrant\": false}' --bf16 true"
    args+=" --tiled_compute false --activation_offload false"
    HF_HUB_OFFLINE=1 python3 -m hf_zero3 plan --model $MODEL --hardware ${HARDWARE:-h200x1} --seq-len "$length" \
      --micro-batch 1 --liger ${PLAN_ARGS:-} --json > "$run/plan.json" 2>/dev/null
    [ -f "$run/ds_config.json" ] || cp ds_configs/zero3.json "$run/ds_config.json"  # ours fits nothing here
    python3 benchmarks/long_seq_bench.py stock-config "$run/plan.json" "$run/ds_config.json" >> "$run/plan.txt"
  fi
  echo "== $(date +%T) $run: $args" | tee -a "$out/long.log"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$run/gpu_mib.txt" 2>/dev/null &
  sampler=$!
  eval "exec timeout ${RUN_TIMEOUT:-300} torchrun --nproc_per_node 1 -m hf_zero3.train recipes/8b/train_args.yaml \
    --model_name_or_path null --config_name $MODEL --tokenizer_name assets/tiny/model \
    --deepspeed $run/ds_config.json --train_file $work/corpus.txt --block_size $length \
    --per_device_train_batch_size 1 --gradient_accumulation_steps 1 --use_liger_kernel true $args \
    --max_steps $steps --logging_steps 1 --save_strategy no --save_final_model false --output_dir $run/out ${EXTRA:-}" \
    > "$run/stdout.log" 2>&1 &
  child=$!; wait "$child"; rc=$?; kill "$sampler" 2>/dev/null; echo "$rc" > "$run/rc.txt"
  peak=$(sort -n "$run/gpu_mib.txt" | tail -1)
  echo "rc $rc, steps $(grep -c step_time_s "$run/out/train_log.jsonl" 2>/dev/null), nvidia-smi peak ${peak:-?} MiB" | tee -a "$out/long.log"
  grep -E "OutOfMemory|out of memory" "$run/stdout.log" | head -2 >> "$out/long.log"
  [ $rc = 0 ] || tail -15 "$run/stdout.log" >> "$out/long.log"
  save_runs
  grep -h step_time_s "$run/train_log.jsonl" 2>/dev/null | cut -c1-400 >> "$out/long.log"
done
