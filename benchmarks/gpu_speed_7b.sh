#!/usr/bin/env bash
# Ours against the competent user on one H200, side by side on one machine: the Llama-2-7B shape (random weights, no
# download), sequence 4096, 16 sequences per step (65,536 tokens), bf16. benchmarks/recipe_proof.py writes the
# planner's one-GPU choice (ours) and runs `hf-zero3 bench` with it against every baseline of `--against tuned`
# (hf_zero3/ops/baselines.py: stock ZeRO-3, ZeRO-2, FSDP2 and the plain Trainer, each with Liger and fused AdamW,
# checkpointing off and on, each at the best micro batch that fits, searched down on out-of-memory), plus ours with
# regional compilation:
#   rc          ours + regional_compile (inductor); Liger then for the fused linear cross-entropy only (the default
#               with compiled layers: the compiler fuses the rest)
#   rc_liger_all  ours + regional_compile with every Liger kernel inside the layers too (failed once on one H200:
#               benchmarks/results/2026-12-04_fp8-smoke-h200)
#   rc_noliger  ours + regional_compile, no Liger (the loss in plain PyTorch)
#   rc_fp8      rc + fp8 (torchao float8 matmuls in the decoder layers, FP8_RECIPE scaling: default tensorwise)
# Repeats are interleaved (every config once, then again); a micro batch search runs in the first round.
# Results: OUT/speed-7b_1xH200_<date>_proof.md (the report: every run, the best baseline, ours against it), its
# .jsonl and .png, rewritten after every run; OUT/speed-7b_bench_state.json (what a later call continues from),
# OUT/proof.log, OUT/gpu.txt (the GPU's name, UUID and driver: the same machine across calls, or not).
#
# Usage, from the repository root:  bash benchmarks/gpu_speed_7b.sh OUT
# One call stops itself within BUDGET_S seconds (default 530): it starts a run only while that run should end in
# time (by its own last run, else the longest so far), and a run cut short is not recorded. Call it again until it
# prints "bench: all runs done": on the same warm machine WORK (default /tmp/hfz-speed-7b) holds the state; on a fresh
# one pass the last call's OUT as PREV. The ~11 configs x 3 repeats (plus the search's out-of-memory attempts, each
# about a minute) take about 9-10 calls; to spend fewer, run round 1 of everything, then rounds 2-3 of the contenders:
#   bash benchmarks/gpu_speed_7b.sh OUT1                                      # again until "all runs done"
#   REPEATS=3 VARIANTS=ours,rc,rc_fp8,stock_tuned_ckpt,plain_tuned_ckpt PREV=OUT1 bash benchmarks/gpu_speed_7b.sh OUT2
# Settings (environment):
#   VARIANTS   configs to run in this call (default: all): ours, rc, rc_liger_all, rc_noliger, rc_fp8; a baseline
#              (stock_tuned, zero2_tuned, fsdp2_tuned, plain_tuned: both settings); one setting (stock_tuned_ckpt,
#              plain_tuned_nockpt, ...); one run without search (stock_tuned_8_ckpt)
#   REPEATS    runs per config (default 3); a call runs what is missing up to it
#   PREV       an earlier call's OUT to continue from (its speed-7b_bench_state.json), when WORK has no state
#   WORK       where the runs write (default /tmp/hfz-speed-7b)
#   BUDGET_S   this call's seconds (default 530, under a 9-minute limit); BENCH_BUDGET_S overrides bench's share
#   STEPS (5: with 3 measured steps ours read about 6% below its 5-step figure), WARMUP (2),
#   RUN_TIMEOUT (300 s: a run past it is stopped and recorded as failed, exit 124)
#   START_CKPT (16), START_NOCKPT (2), START_PLAIN_CKPT (8), START_PLAIN_NOCKPT (1): where each baseline's micro batch
#              search starts (the divisors of 16 below it follow on out-of-memory). Measured fits: ZeRO-3 with
#              checkpointing and Liger at 8, the plain Trainer with checkpointing and Liger at 4, ZeRO-3 without
#              checkpointing at 1; starting one above shows the larger one does not fit
#   RC_BACKEND (inductor), FP8_RECIPE (tensorwise; rowwise, rowwise_with_gw_hp)
#   DRY=1      the same on this machine's CPU with the tiny model (seq 128, 4 sequences per step, 1 measured step,
#              regional compilation traced with aot_eager): checks the plumbing, not the speed
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_speed_7b.sh OUT   (settings: see the header)}
source benchmarks/common.sh || exit 1  # GPU box set-up
budget=${BUDGET_S:-530}
work=${WORK:-/tmp/hfz-speed-7b}
mkdir -p "$out"
if [ "${DRY:-0}" = 1 ]; then
  tag=speed-tiny
  shape=(--recipe tiny --cpu --seq-len 128 --global-batch 4)
  steps=${STEPS:-1} warmup=${WARMUP:-1}
  start_ckpt=${START_CKPT:-4} start_nockpt=${START_NOCKPT:-2} start_plain_ckpt=${START_PLAIN_CKPT:-4}
  start_plain_nockpt=${START_PLAIN_NOCKPT:-1} backend=${RC_BACKEND:-aot_eager}
else
  tag=speed-7b
  shape=(--recipe 7b --seq-len 4096 --global-batch 16)
  steps=${STEPS:-5} warmup=${WARMUP:-2}
  start_ckpt=${START_CKPT:-16} start_nockpt=${START_NOCKPT:-2} start_plain_ckpt=${START_PLAIN_CKPT:-8}
  start_plain_nockpt=${START_PLAIN_NOCKPT:-1} backend=${RC_BACKEND:-inductor}
fi
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv >> "$out/gpu.txt" 2>&1 || echo "no GPU" >> "$out/gpu.txt"
state="$work/$tag/runs/bench_state.json"
if [ ! -f "$state" ] && [ -n "${PREV:-}" ]; then
  if [ ! -f "$PREV/${tag}_bench_state.json" ]; then
    echo "error: PREV=$PREV has no ${tag}_bench_state.json: give the OUT of an earlier call of this script" >&2
    exit 2
  fi
  mkdir -p "$(dirname "$state")" && cp "$PREV/${tag}_bench_state.json" "$state"
  echo "continuing from $PREV/${tag}_bench_state.json" | tee -a "$out/proof.log"
fi
rc_common='train.regional_compile=true,train.regional_compile_backend="'$backend'"'
fp8='train.fp8=true,train.fp8_recipe="'${FP8_RECIPE:-tensorwise}'"'
liger_all='{"fused_linear_cross_entropy":true,"cross_entropy":false,"rms_norm":true,"swiglu":true,"rope":true}'
against=(--against tuned
         --tuned "stock_tuned=$start_nockpt" --tuned "stock_tuned=$start_ckpt+ckpt"
         --tuned "zero2_tuned=$start_nockpt" --tuned "zero2_tuned=$start_ckpt+ckpt"
         --tuned "fsdp2_tuned=$start_nockpt" --tuned "fsdp2_tuned=$start_ckpt+ckpt"
         --tuned "plain_tuned=$start_plain_nockpt" --tuned "plain_tuned=$start_plain_ckpt+ckpt")
variants=(--variant "rc=$rc_common"
          --variant "rc_liger_all=$rc_common,train.liger_kernel_config=$liger_all"
          --variant "rc_noliger=$rc_common,train.use_liger_kernel=false"
          --variant "rc_fp8=$rc_common,$fp8")
bench_budget=${BENCH_BUDGET_S:-$(( budget - SECONDS - 40 ))}  # 40 s for the planner, the start-up and the copies
[ "$bench_budget" -ge 1 ] || bench_budget=1
host_ram=${HOST_RAM:-$(awk '/MemTotal/ {printf "%dKiB", $2}' /proc/meminfo)}
timeout -s TERM -k 30 $(( budget - SECONDS > 10 ? budget - SECONDS : 10 )) python3 benchmarks/recipe_proof.py \
  "${shape[@]}" --gpus 1 --gpu-mem "${GPU_MEM:-141GiB}" --host-ram "$host_ram" --tag "$tag" \
  --steps "$steps" --warmup "$warmup" --repeats "${REPEATS:-3}" --run-timeout "${RUN_TIMEOUT:-300}" \
  --time-budget "$bench_budget" --resume "${against[@]}" "${variants[@]}" \
  ${VARIANTS:+--only "$VARIANTS"} --out "$out" --work "$work" 2>&1 | tee -a "$out/proof.log"
rc=${PIPESTATUS[0]}
[ -f "$state" ] && cp "$state" "$out/${tag}_bench_state.json"
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "gpu_speed_7b: stopped at the $budget s budget; finished runs are kept: call again to continue" | tee -a "$out/proof.log"
fi
exit "$rc"
