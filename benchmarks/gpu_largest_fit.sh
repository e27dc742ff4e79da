#!/usr/bin/env bash
# The largest full fine-tune the planner fits on the box at hand, run as its recipe ships:
#   RECIPE=20b-h200x2 GPUS=2 (default): a 20.7B Llama on 2 x H200, partial optimizer offload (ratio 0.5)
#   RECIPE=10b-h200x1 GPUS=1          : a 10.7B Llama (SOLAR-10.7B's shape) on 1 x H200, ratio 0.4
# Random weights from the recipe's config_overrides, seq 4096, the recipe's ds_config and batch (MICRO and ACCUM
# override the micro batch and the accumulation), STEPS (default 20) real optimizer steps. Measures peak GPU memory (allocated, every
# rank, from the run's JSONL log), host RAM of the node (MemTotal - MemAvailable, every second, minus its value
# before the launch), tokens/s/GPU and MFU (the throughput callback), against benchmarks/offload_plan_check.py's
# prediction for this box. Results in $OUT as they come (summary.md first).
# Run from the repository root:  bash benchmarks/gpu_largest_fit.sh   (about 7 minutes; CHECK_ONLY=1: no GPU part)
# Variants of the recipe's ds_config: PIN_MEMORY=true|false (offload_optimizer.pin_memory), BREAKDOWN=1 (DeepSpeed's
# wall_clock_breakdown timers in train.log), GATHER=true|false (stage3_gather_16bit_weights_on_model_save: the final
# save_model gathers the 16-bit model into rank 0's host RAM, or writes ZeRO shards; without GATHER there is no
# final save: recipe 10b-h200x1's ZeRO shards, 129 GB, do not fit the single-H200 box's 64 GiB disk), PERSIST=N
# (stage3_param_persistence_threshold; 9223372036854775807 = every parameter, the planner's one-GPU choice). E.g. the
# 10b's pinned run: RECIPE=10b-h200x1 GPUS=1 PIN_MEMORY=true BREAKDOWN=1
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
RECIPE=${RECIPE:-20b-h200x2} GPUS=${GPUS:-2} STEPS=${STEPS:-20} TIMEOUT=${TIMEOUT:-420}
OUT=${OUT:-outputs/gpu-largest-$RECIPE}
WORK=${WORK:-outputs/largest-$RECIPE}
mkdir -p "$OUT" && scratch_dir "$WORK" || exit 2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / GPUS ))}  # CPU Adam: the cores shared among the ranks
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.md"; }
read -r micro accum overrides < <(python3 - "recipes/$RECIPE/train_args.yaml" <<'PY'
import sys, yaml
v = yaml.safe_load(open(sys.argv[1]))
print(v["per_device_train_batch_size"], v["gradient_accumulation_steps"], v["config_overrides"])
PY
)
micro=${MICRO:-$micro} accum=${ACCUM:-$accum}
log "recipe $RECIPE on $GPUS GPU(s): micro $micro x accumulation $accum, $STEPS steps"
config="recipes/$RECIPE/ds_config.json"
if [ -n "${PIN_MEMORY:-}${BREAKDOWN:-}${GATHER:-}${PERSIST:-}" ]; then  # a variant of the recipe's config, written beside the run
  python3 - "$config" "$WORK/ds_config.json" "${PIN_MEMORY:-}" "${BREAKDOWN:-}" "${GATHER:-}" "${PERSIST:-}" <<'PY'
import json, sys
src, dst, pin, breakdown, gather, persist = sys.argv[1:]
config = json.load(open(src))
if pin:
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = pin == "true"
if breakdown:
    config["wall_clock_breakdown"] = True
if gather:
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather == "true"
if persist:
    config["zero_optimization"]["stage3_param_persistence_threshold"] = int(persist)
json.dump(config, open(dst, "w"), indent=2)
PY
  config="$WORK/ds_config.json"
  log "ds_config: the recipe's with pin_memory=${PIN_MEMORY:-as shipped}, wall_clock_breakdown=${BREAKDOWN:-as shipped}, 16-bit gather on save=${GATHER:-as shipped}, persistence threshold=${PERSIST:-as shipped}"
fi
cp "$config" "$OUT/ds_config.json"
python3 benchmarks/offload_plan_check.py predict --ds-config "$config" --model assets/tiny/model \
  --overrides "$overrides" --checkpointing --gpus "$GPUS" --gpu-mem 140GiB \
  --host-ram "$(awk '/MemTotal/ {printf "%.0f", $2 * 1024}' /proc/meminfo)" --micro "$micro" --accum "$accum" \
  --seq 4096 --from-scratch > "$OUT/predicted.json"
log "predicted: $(python3 -c "import json; d=json.load(open('$OUT/predicted.json')); print(d['option'], {k: round(d[k] / 2**30, 1) for k in ('gpu_allocated_bytes', 'gpu_bytes', 'host_bytes')}, 'GiB; params', d['model']['params'], 'fits', d['fits'], d['problems'])")"
if [ -n "${CHECK_ONLY:-}" ]; then log "CHECK_ONLY: stopping before the GPU part"; exit 0; fi

{ nvidia-smi; free -g; nproc; } > "$OUT/machine.txt" 2>&1
timeout 300 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load(); print('cpu_adam built')" > "$OUT/build_cpu_adam.log" 2>&1
log "build: $(tail -1 "$OUT/build_cpu_adam.log")"
echo "0 $(awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {printf "%.0f\n", (t - a) * 1024}' /proc/meminfo)" > "$OUT/host_samples.tsv"
( while sleep 1; do echo "$SECONDS $(awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {printf "%.0f\n", (t - a) * 1024}' /proc/meminfo)"; done >> "$OUT/host_samples.tsv" ) &
host_pid=$!
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv -l 2 > "$OUT/nvidia_smi.csv" 2>&1 &
smi_pid=$!
start=$(date +%s)
NUM_GPUS=$GPUS timeout "$TIMEOUT" "recipes/$RECIPE/launch.sh" --train_file assets/tiny/corpus/train.txt --deepspeed "$(realpath "$config")" \
  --per_device_train_batch_size "$micro" --gradient_accumulation_steps "$accum" --max_steps "$STEPS" --warmup_steps 2 --logging_steps 1 \
  --save_strategy no --save_final_model "$( [ -n "${GATHER:-}" ] && echo true || echo false )" --output_dir "$WORK/run" > "$OUT/train.log" 2>&1
rc=$?
kill $host_pid $smi_pid 2>/dev/null
cp "$WORK/run/train_log.jsonl" "$OUT/" 2>/dev/null
log "run: exit $rc in $(( $(date +%s) - start )) s; steps logged: $(grep -c '"step_time_s"' "$OUT/train_log.jsonl" 2>/dev/null)"
grep -E "Error|error:|Traceback|out of memory" "$OUT/train.log" | tail -5 >> "$OUT/summary.md"
python3 benchmarks/offload_plan_check.py compare --pred "$OUT/predicted.json" --log "$OUT/train_log.jsonl" \
  --host-samples "$OUT/host_samples.tsv" | tee -a "$OUT/summary.md"
python3 - "$OUT/train_log.jsonl" <<'PY' | tee -a "$OUT/summary.md"
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()] if __import__("os").path.exists(sys.argv[1]) else []
speed = [r for r in rows if "tokens_per_s_per_gpu" in r]
if speed:
    late = speed[len(speed) // 2:]  # the second half: past the first steps' warm-up
    mean = lambda k: sum(r[k] for r in late if r.get(k) is not None) / max(1, sum(r.get(k) is not None for r in late))
    print(f"second half of {len(speed)} logged steps: step {mean('step_time_s'):.2f} s, "
          f"{mean('tokens_per_s_per_gpu'):.0f} tokens/s/GPU, MFU {mean('mfu'):.3f}; loss {speed[-1].get('loss')}")
PY
log "done"
