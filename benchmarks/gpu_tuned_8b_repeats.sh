#!/usr/bin/env bash
# Issue 13, second lease: ZeRO-2 + Liger at its best micro batch and more runs of zero2_tuned and fsdp2_tuned, with
# recipe 8b v2 ("ours") and stock_tuned in the same lease (ratios hold only within one lease). The runs and their
# configs are those of benchmarks/gpu_tuned_8b.sh (it is called with a subset: `--only`, `--resume`); this script only
# picks which runs each call makes, so one call fits a 10-minute device call.
#
# Run from the repository root on 2 x H200, the calls one after the other on the same warm machine (the work dir,
# outputs/bench-8b-repeats, carries the runs of earlier calls; the report in OUT_DIR holds every run so far):
#   PART=1 bash benchmarks/gpu_tuned_8b_repeats.sh "$OUT"   # ours 1, zero2_liger 1, stock_tuned 1, zero2_tuned 1
#   PART=2 bash benchmarks/gpu_tuned_8b_repeats.sh "$OUT"   # fsdp2_tuned 1, zero2_tuned 2, fsdp2_tuned 2
#   PART=3 bash benchmarks/gpu_tuned_8b_repeats.sh "$OUT"   # optional: ours 2, zero2_liger 2, stock_tuned 2
# If zero2_liger (micro 2) failed in part 1 (out of memory: planned 111 GiB allocated + ZeRO-2's fragmentation), part
# 2 runs fsdp2_tuned 1 and zero2_liger_m1 (ZeRO-2 + Liger, micro 1 x 6) instead, and part 3 its second run.
#
# Time, from the first lease's measured wall time per run (benchmarks/README.md: a ZeRO-3 run 63-73 s, a ZeRO-2 or
# FSDP2 run 152-155 s, each start-up included; 4 measured steps after 1 warm-up): part 1 = 73 + 155 + 73 + 155 + ~20 s
# of set-up and reports = ~8.0 min; part 2 = 3 x 155 + ~20 = ~8.1 min; part 3 = 73 + 155 + 73 + 20 = ~5.4 min; plus,
# on a fresh machine, installing .whl/ (DeepSpeed built from source: not timed here, assume ~1 min). So parts 1 and 2
# are at the 8-minute mark, not under it. Each part stops itself BUDGET_S (default 570) seconds after it started (the
# run in flight is stopped, every finished run is kept in the report) and copies its logs and state into OUT_DIR, so
# nothing is lost under a 600 s call limit; running the same PART again finishes what was cut (recorded runs are
# skipped). Most needed first: part 1 (ZeRO-2 + Liger against recipe 8b v2 and both stocks), then part 2.
# Plumbing check on CPU (tiny widths, no speed; parts 1/2/3 took 7/3/6 min on 2 cores, all runs exit 0): for p in 1 2
# 3; do PART=$p GPUS=2 TRAIN_OVERRIDES="--config_overrides num_hidden_layers=1,hidden_size=64,intermediate_size=128,\
# num_attention_heads=4,num_key_value_heads=2,vocab_size=1024 --block_size 64" bash benchmarks/gpu_tuned_8b_repeats.sh \
# /tmp/o; done  (the zero2_liger_m1 fallback was checked by marking run 1 of zero2_liger failed in bench_state.json)
set -uo pipefail
if [ -f .whl/install.sh ]; then source .whl/install.sh; fi
export TORCH_CUDA_ARCH_LIST=9.0
out=${1:-${OUT:-outputs/bench-8b-repeats-out}}
work=${WORK_DIR:-outputs/bench-8b-repeats}
part=${PART:-1}
mkdir -p "$out" "$work"
{ date -u; nvidia-smi || true; free -g || true; } > "$out/machine_part$part.txt" 2>&1

z2_failed() {  # did the micro-2 ZeRO-2 + Liger candidate's first run fail (in this work dir)?
  python3 - "$work/bench_state.json" <<'PY'
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"].get("zero2_liger", {})
except FileNotFoundError:
    runs = {}
print("yes" if "error" in runs.get("1", {}).get("summary", {}) else "no")
PY
}

micro=2
case $part in
  1) args=(--repeats 1 --only ours,zero2_liger,stock_tuned,zero2_tuned) ;;
  2) if [ "$(z2_failed)" = yes ]; then micro=1; args=(--repeats 1 --only zero2_liger_m1,fsdp2_tuned)
     else args=(--repeats 2 --only zero2_tuned,fsdp2_tuned); fi ;;
  3) if [ "$(z2_failed)" = yes ]; then micro=1; args=(--repeats 2 --only ours,zero2_liger_m1,stock_tuned)
     else args=(--repeats 2 --only ours,zero2_liger,stock_tuned); fi ;;
  *) echo "PART must be 1, 2 or 3 (got $part)" >&2; exit 2 ;;
esac
echo "part $part: ${args[*]} (ZeRO-2 + Liger at micro $micro)" | tee "$out/plan_part$part.txt"
start=$(date +%s)
left=$(( ${BUDGET_S:-570} - SECONDS ))
ZERO2_LIGER=1 ZERO2_LIGER_MICRO=$micro timeout -s TERM "$(( left > 30 ? left : 30 ))" \
  bash benchmarks/gpu_tuned_8b.sh "$out" "$work" --suffix tuned-repeats --resume "${args[@]}" \
  2>&1 | tee "$out/bench_part$part.log"
rc=${PIPESTATUS[0]}
echo "part $part: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$out/plan_part$part.txt"
mkdir -p "$out/work"
cp "$work"/bench_state.json "$work"/*.log "$work"/*_ds_config.json "$out/work/" 2>/dev/null || true
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv >> "$out/machine_part$part.txt" 2>&1 || true
exit "$rc"
