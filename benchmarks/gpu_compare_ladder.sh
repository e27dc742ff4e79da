#!/usr/bin/env bash
# The seed's claims ("up to 70% less VRAM, same convergence") on 2 x H200: `hf-zero3 compare` trains one Llama-shaped 1.1B model (TinyLlama's shape: hidden 2048,
# 22 layers, ffn 5632, 32 heads / 4 kv heads, vocab 32,000 untied; random init made once, fp32, saved, loaded by
# every rung) on real English text (Debian's python3.11-doc reST sources, scripts/prepare_python_docs_corpus.py;
# 1.38M train tokens, 73k held out) under each rung: DDP (twice: data-loader seeds 42 and 43, the bf16 spread),
# ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-3 + activation checkpointing, + optimizer offload, + parameter offload, + NVMe.
# bf16, sequence 1024, micro batch 2 x 2 GPUs (4,096 tokens/step; 500 steps = 2.05M tokens, ~1.5 epochs),
# lr 3e-4 cosine, warmup 50, clip 1.0, no weight decay, seed 42; held-out loss/perplexity on 64 blocks at the end.
#
# Run it in pieces of <= 9 minutes from the repository root (each call: the ladder under `timeout` LIMIT=480 s,
# ~1 min left for .whl/install.sh on a fresh machine; a rung past RUN_TIMEOUT=450 s is stopped and reported failed). Rungs already recorded are skipped, so the same command can be
# repeated: on a warm machine they are kept in $HOME/hfz-compare; on a fresh one pass PREV=<an earlier $OUT>
# (its rungs/ is copied in). The same seed gives the same initial weights on any machine (sha256 in each rung).
#   RUNGS=ddp,ddp_seed2                     bash benchmarks/gpu_compare_ladder.sh   # ~6 min (first call +1 min: model init)
#   RUNGS=zero1,zero2                       bash benchmarks/gpu_compare_ladder.sh   # ~5 min
#   RUNGS=zero3,zero3_ckpt                  bash benchmarks/gpu_compare_ladder.sh   # ~6 min
#   RUNGS=zero3_ckpt_offload_opt            bash benchmarks/gpu_compare_ladder.sh   # ~6-8 min (+1 min cpu_adam JIT build)
#   RUNGS=zero3_ckpt_offload_all            bash benchmarks/gpu_compare_ladder.sh   # ~7-9 min: may hit RUN_TIMEOUT
#   RUNGS=zero3_ckpt_nvme                   bash benchmarks/gpu_compare_ladder.sh   # libaio from .whl/libaio (carry .whl);
#     NVME_STEPS (default 20) steps only: every step reads and writes the 1.1B model's ~35 GB of offloaded states on
#     the disk (2.3-2.5 GB/s on the 2 x H200 box: ~15 s per step, so 500 steps would take 2 hours). Its memory and
#     speed are measured; its loss is compared with DDP's over those 20 steps only.
# Estimates per rung (not measured yet): start-up ~60-80 s (imports, 4.4 GB fp32 load, DeepSpeed init, tokenizing
# 6.6 MB once), then 500 steps at ~0.10-0.25 s (DDP, ZeRO-1/2/3, + checkpointing: 1.1B x 2,048 tokens per GPU is
# ~15 TFLOP per step per GPU), ~0.5-0.7 s (+ optimizer offload: DeepSpeedCPUAdam over 0.55B params per rank),
# ~0.7-1.0 s (+ parameter offload: 2.2 GB of bf16 weights over PCIe 3x per step). Whole ladder: ~35-40 GPU-minutes.
# One GPU (the single-H200 box): GPUS=1 (micro 4, the same 4 sequences per step). There ZeRO partitions nothing, so
# the ladder measures what the seed's sentence names (mixed precision, checkpointing, offload) and not the
# partitioning; ZeRO-1/2 add nothing over ZeRO-3 at world size 1 and can be left out:
#   GPUS=1 RUNGS=ddp,ddp_seed2,zero3,zero3_ckpt,zero3_ckpt_offload_opt,zero3_ckpt_offload_all
# FP8 against bf16 (the loss curve `fp8` must match before it is on by default): zero3_rc (each decoder layer
# compiled) and zero3_fp8 (that with torchao float8 matmuls), judged against the DDP pair's seed spread:
#   GPUS=1 RUNGS=ddp,ddp_seed2,zero3_rc,zero3_fp8 bash benchmarks/gpu_compare_ladder.sh   # ~18 min: run it twice
# STOP_AFTER=N stops each rung of the call after its first N steps of the STEPS schedule (same learning rates, so
# its losses compare step by step with the full rungs): the slow rungs within a short device call.
# STEPS=100 gives a quick look (~15 min for all) that is not the 500-step schedule.
# Then, anywhere (CPU too): python -m hf_zero3 compare tiny --report-only --out <dir with rungs/> --label <label>
# CPU smoke test of this script: SMOKE=1 OUT=/tmp/o bash benchmarks/gpu_compare_ladder.sh (2-layer, hidden 128, 20 steps, no GPU; checked here: ddp, ddp_seed2, zero1, offload_opt, NVMe skip, and the resume of recorded rungs).
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
OUT=${OUT:-outputs/gpu-compare}
STEPS=${STEPS:-500}
RUNGS=${RUNGS:-ddp,ddp_seed2}
RUN_TIMEOUT=${RUN_TIMEOUT:-450}
LIMIT=${LIMIT:-480}
CORPUS=${CORPUS:-$( [ -d corpus ] || [ ! -d .gpuwork/corpus ] && echo corpus || echo .gpuwork/corpus)}
STATE=${STATE:-$HOME/hfz-compare}
GPUS=${GPUS:-2}
MICRO=${MICRO:-$((4 / GPUS))}  # 4 sequences per optimizer step on 1 or 2 GPUs (4,096 tokens)
LABEL=${LABEL:-seed_claims_${GPUS}xH200_$(date -u +%F)}
mkdir -p "$OUT/rungs" "$OUT/logs" "$STATE/out/rungs" "$STATE/work"
[ -n "${PREV:-}" ] && cp -n "$PREV"/rungs/* "$OUT/rungs/" 2>/dev/null
cp -n "$STATE"/out/rungs/* "$OUT/rungs/" 2>/dev/null
{ nvidia-smi || true; free -g; nproc; df -h "$STATE"; } > "$OUT/logs/machine_$(date -u +%H%M%S).txt" 2>&1
for f in train.jsonl validation.jsonl tokenizer/tokenizer.json manifest.json; do
  [ -f "$CORPUS/$f" ] || { echo "error: $CORPUS/$f missing: run scripts/prepare_python_docs_corpus.py (see its docstring) and carry its output folder as $CORPUS" >&2; exit 2; }
done
cp "$CORPUS/manifest.json" "$OUT/corpus_manifest.json"
if [ "${SMOKE:-0}" = 1 ]; then  # CPU check of the plumbing: a 2-layer model, 20 steps
  LAYERS=2 HIDDEN=128 FFN=352 HEADS=4 KV=2 SEQ=128 STEPS=${STEPS_SMOKE:-20} PRECISION="--bf16 false"
  LABEL=smoke_cpu
else
  LAYERS=22 HIDDEN=2048 FFN=5632 HEADS=32 KV=4 SEQ=1024 PRECISION="--bf16 true"
fi
model="$STATE/model-config-${LAYERS}x${HIDDEN}"
[ -f "$model/config.json" ] || python3 - "$model" "$CORPUS/tokenizer" $LAYERS $HIDDEN $FFN $HEADS $KV <<'PY'
import sys
from transformers import AutoTokenizer, LlamaConfig
folder, tok, layers, hidden, ffn, heads, kv = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
tokenizer = AutoTokenizer.from_pretrained(tok)
LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv, vocab_size=len(tokenizer), max_position_embeddings=2048, rope_theta=10000.0,
            tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)
tokenizer.save_pretrained(folder)
PY
mkdir -p "$STATE/nvme"
timeout "$LIMIT" python3 -m hf_zero3 compare tiny --rungs "$RUNGS" --steps "$STEPS" --warmup 10 --gpus "$GPUS" \
  --run-timeout "$RUN_TIMEOUT" --nvme-path "$STATE/nvme" --nvme-steps "${NVME_STEPS:-20}" ${STOP_AFTER:+--stop-after $STOP_AFTER} --label "$LABEL" --out "$OUT" --work-dir "$STATE/work" -- \
  --config_name "$model" --tokenizer_name "$model" --train_file "$CORPUS/train.jsonl" \
  --validation_file "$CORPUS/validation.jsonl" --block_size $SEQ --per_device_train_batch_size $MICRO \
  --gradient_accumulation_steps 1 --learning_rate 3.0e-4 --lr_scheduler_type cosine --warmup_steps 50 \
  --weight_decay 0.0 --max_grad_norm 1.0 --seed 42 --max_eval_samples 64 --per_device_eval_batch_size 2 $PRECISION \
  2>&1 | tee "$OUT/logs/compare_$(date -u +%H%M%S).log"
code=${PIPESTATUS[0]}
cp "$STATE"/work/*.log "$OUT/logs/" 2>/dev/null
cp -n "$OUT"/rungs/* "$STATE/out/rungs/" 2>/dev/null
echo "compare exit $code; rungs recorded: $(ls "$OUT/rungs" | grep -c '\.json$')"
exit $code
