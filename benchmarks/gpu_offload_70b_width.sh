#!/usr/bin/env bash
# NVMe offload at 70B width: the offload path the planner picks for 70b on p4d.24xlarge (ZeRO-3 + optimizer states on NVMe +
# checkpointing, recipes/70b v2), proven layer-scaled on a 2 x H200 box: Llama-2-70B's exact width (hidden 8192,
# 64 heads, 8 kv heads, ffn 28672, vocab 32000) with LAYERS layers (default 2: the swap folder holds 16 B/param, and
# each step reads and writes 12 B/param of it), random weights, seq 4096, micro 1, the planner's own ds_config with
# nvme_path pointed at a folder on the local disk (wall_clock_breakdown on for DeepSpeed's timers).
# Measures, against benchmarks/offload_plan_check.py's prediction: peak GPU memory (allocated, every rank), host RAM
# of the node (MemTotal - MemAvailable, sampled every second), NVMe bytes (size of the swap folder, every 2 s, and
# /proc/diskstats before/after); and what bounds the step (benchmarks/offload_rates.py: dd write/read GB/s of the
# folder, pinned host<->GPU GB/s, DeepSpeedCPUAdam params/s).
# DeepSpeed's async_io op JIT-builds against libaio: benchmarks/common.sh provides it from .whl/libaio if need be.
# Run from the repository root:  bash benchmarks/gpu_offload_70b_width.sh   (about 6 minutes; results in $OUT)
# Settings: LAYERS=2 STEPS=3 GPUS=2 NVME_DIR=<a folder on the NVMe mount, default $HOME> (the swap goes into a new
# hfz-nvme-swap-<pid> folder inside it, removed at the end); CHECK_ONLY=1 stops before anything needs a GPU.
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
OUT=${OUT:-outputs/gpu-offload-70b-width}
mkdir -p "$OUT"
LAYERS=${LAYERS:-2} STEPS=${STEPS:-3} GPUS=${GPUS:-2}
NVME_DIR=${NVME_DIR:-$HOME}/hfz-nvme-swap-$$  # our own folder on that mount: only it is removed
WORK=${WORK:-outputs/offload-70b-width}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / GPUS ))}  # CPU Adam: the cores shared among the ranks
scratch_dir "$NVME_DIR" && scratch_dir "$WORK" || exit 2
trap 'rm -rf "$NVME_DIR" "$NVME_DIR.owner"' EXIT  # our own swap folder, however the script ends
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.md"; }

# --- libaio (benchmarks/common.sh) ---
AIO=${HFZ_AIO:-/tmp/hfz-libaio}
log "libaio: $(ls $AIO/lib $AIO/include | tr '\n' ' ')"

# --- the model, the planner's ds_config for p4d.24xlarge, the prediction for this box ---
python3 - "$WORK/llama-70b-w$LAYERS" "$LAYERS" <<'PY'
import sys
from transformers import LlamaConfig
LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=int(sys.argv[2]), num_attention_heads=64,
            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=1, pad_token_id=3).save_pretrained(sys.argv[1])
PY
python3 -m hf_zero3 plan --model 70b --hardware p4d.24xlarge --headroom 0.1 --global-batch 64 --nvme-path "$NVME_DIR" \
  --write-config "$WORK/ds_config.planner.json" > "$OUT/plan_p4d.txt" 2>&1
log "planner for p4d.24xlarge: $(grep '^choice' "$OUT/plan_p4d.txt")"
python3 - "$WORK" "$NVME_DIR" <<'PY' | tee -a "$OUT/summary.md"
import json, sys
work, nvme = sys.argv[1:]
planner = json.load(open(f"{work}/ds_config.planner.json"))
recipe = json.load(open("recipes/70b/ds_config.json"))
recipe["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme
batch = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
same = {k: v for k, v in planner.items() if k not in batch} == {k: v for k, v in recipe.items() if k not in batch}
print("ds_config: the planner's choice for p4d.24xlarge", "==" if same else "!= (DIFFERS FROM)",
      "recipes/70b/ds_config.json (nvme_path and the batch sizes it fills for 8 GPUs aside)")
recipe["wall_clock_breakdown"] = True
json.dump(recipe, open(f"{work}/ds_config.json", "w"), indent=2)
PY
cp "$WORK/ds_config.json" "$OUT/ds_config.json"
free_bytes=$(df -B1 --output=avail "$NVME_DIR" | tail -1)
python3 benchmarks/offload_plan_check.py predict --ds-config "$WORK/ds_config.json" --model "$WORK/llama-70b-w$LAYERS" \
  --checkpointing --gpus "$GPUS" --gpu-mem 140GiB --host-ram "$(awk '/MemTotal/ {printf "%.0f", $2 * 1024}' /proc/meminfo)" \
  --nvme-path "$NVME_DIR" --nvme-free "$free_bytes" --micro 1 --accum 1 --seq 4096 --from-scratch > "$OUT/predicted.json"
log "predicted: $(python3 -c "import json; d=json.load(open('$OUT/predicted.json')); print(d['option'], {k: round(d[k] / 2**30, 1) for k in ('gpu_allocated_bytes', 'host_bytes', 'nvme_bytes')}, 'GiB; params', d['model']['params'])")"
if [ -n "${CHECK_ONLY:-}" ]; then log "CHECK_ONLY: stopping before the GPU part"; exit 0; fi

# --- the disk, the copies and CPU Adam's rate (dd first: it needs the empty disk) ---
{ nvidia-smi; free -g; df -h "$NVME_DIR"; lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT; nproc; } > "$OUT/machine.txt" 2>&1
timeout 90 python3 benchmarks/offload_rates.py --nvme-dir "$NVME_DIR" --nvme-gb 4 --adam-elements 0 \
  > "$OUT/rates_disk.json" 2> "$OUT/rates_disk.err"
log "disk + PCIe: $(cat "$OUT/rates_disk.json")"
# async_io and cpu_adam JIT builds, in parallel, before the run (so their minutes are not in its timeout)
timeout 420 python3 -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; b = B(); print('async_io compatible:', b.is_compatible(verbose=True)); b.load(); print('async_io built')" > "$OUT/build_aio.log" 2>&1 &
aio_pid=$!
timeout 420 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder as B; B().load(); print('cpu_adam built')" > "$OUT/build_cpu_adam.log" 2>&1
wait $aio_pid
find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -size 0 -mmin +6 -print -delete 2>/dev/null  # a build cut short
log "builds: $(tail -1 "$OUT/build_aio.log"); $(tail -1 "$OUT/build_cpu_adam.log")"

# --- the run, sampled ---
dev=$(df --output=source "$NVME_DIR" | tail -1 | sed 's#/dev/##')
cat /proc/diskstats > "$OUT/diskstats_before.txt"
echo "0 $(awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {printf "%.0f\n", (t - a) * 1024}' /proc/meminfo)" > "$OUT/host_samples.tsv"
( while sleep 1; do echo "$SECONDS $(awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {printf "%.0f\n", (t - a) * 1024}' /proc/meminfo)"; done >> "$OUT/host_samples.tsv" ) &
host_pid=$!
( while sleep 2; do echo "$SECONDS $(du -sb "$NVME_DIR" 2>/dev/null | cut -f1)"; done > "$OUT/nvme_samples.tsv" ) &
nvme_pid=$!
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv -l 2 > "$OUT/nvidia_smi.csv" 2>&1 &
smi_pid=$!
start=$(date +%s)
timeout 330 deepspeed --num_gpus "$GPUS" benchmarks/memory_probe.py --probe_out "$OUT/probe" recipes/70b/train_args.yaml \
  --deepspeed "$WORK/ds_config.json" --model_name_or_path null --config_name "$WORK/llama-70b-w$LAYERS" \
  --tokenizer_name assets/tiny/model --train_file assets/tiny/corpus/train.txt --block_size 4096 \
  --per_device_train_batch_size 1 --gradient_accumulation_steps 1 --max_steps "$STEPS" --warmup_steps 1 \
  --logging_steps 1 --save_strategy no --report_to none --output_dir "$WORK/run" --overwrite_output_dir true \
  > "$OUT/train.log" 2>&1
rc=$?
kill $host_pid $nvme_pid $smi_pid 2>/dev/null
cat /proc/diskstats > "$OUT/diskstats_after.txt"
cp "$WORK/run/train_log.jsonl" "$OUT/" 2>/dev/null
log "run: exit $rc in $(( $(date +%s) - start )) s; $(grep -E 'memory_probe:' "$OUT/train.log" | tail -1 | cut -c1-400)"
grep -E "Error|error|Traceback" "$OUT/train.log" | tail -5 >> "$OUT/summary.md"
python3 - "$dev" "$OUT" <<'PY' | tee -a "$OUT/summary.md"
import sys
dev, out = sys.argv[1:]
def sectors(path):
    for line in open(path):
        f = line.split()
        if f[2] == dev:
            return int(f[5]), int(f[9])  # sectors read, sectors written (512 B)
    return None
a, b = sectors(f"{out}/diskstats_before.txt"), sectors(f"{out}/diskstats_after.txt")
if a and b:
    print(f"disk {dev}: read {(b[0] - a[0]) * 512 / 2**30:.1f} GiB, written {(b[1] - a[1]) * 512 / 2**30:.1f} GiB during the run")
else:
    print(f"disk {dev}: not found in /proc/diskstats")
PY
grep -E "optimizer_step|swap|fwd_microstep|bwd_microstep|step_microstep" "$OUT/train.log" | tail -12 > "$OUT/ds_timers.txt"
python3 benchmarks/offload_plan_check.py compare --pred "$OUT/predicted.json" --log "$OUT/train_log.jsonl" \
  --probe "$OUT/probe/probe_rank0.json" --host-samples "$OUT/host_samples.tsv" --nvme-samples "$OUT/nvme_samples.tsv" \
  | tee -a "$OUT/summary.md"
for r in 1 2 3 4 5 6 7; do [ -f "$OUT/probe/probe_rank$r.json" ] && python3 -c "import json; d=json.load(open('$OUT/probe/probe_rank$r.json')); print('rank $r peak allocated GiB', round(d['max_memory_allocated_gib'], 2))" >> "$OUT/summary.md"; done
# CPU Adam rate last (the run built the op): one rank's share of a 70b step on p4d is 8.6B params
timeout 90 python3 benchmarks/offload_rates.py --adam-elements 500000000 --copy-gb 4 > "$OUT/rates_cpu_adam.json" 2> "$OUT/rates_cpu_adam.err"
log "CPU Adam + PCIe: $(cat "$OUT/rates_cpu_adam.json")"
log "done"
