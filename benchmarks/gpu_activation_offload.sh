#!/usr/bin/env bash
# Activation offload on 2 x H200, from the repository root: Llama-3-8B-shaped model (random weights),
# ZeRO-3 (recipes/8b/ds_config.json), bf16, Liger, sdpa, non-reentrant gradient checkpointing, micro batch 1.
#   1. benchmarks/activation_offload_bench.py once without and once with offload: seq 4096 and 16384 (5 steps
#      each; medians of steps 3-5), then the longest sequence that fits one step under a GPU cap of the states held
#      between steps + CAP_GIB (default 24: gathered parameters, the step's 4 GiB fp32 gradient sub-group and ~16 GiB
#      for activations; on the whole 141 GB the search would take minutes per attempt), stopping at the first OOM.
#   2. `hf-zero3 train` with --activation_offload true, 4 steps at 4096 (the Trainer path end to end).
#   3. optional (ONE_GPU_3B=1): a ~3B Llama on 1 GPU, without and with offload (SKIP_8B=1: only this part).
# Every run sits in its own `timeout`; everything lands in OUT as it comes. About 6-7 minutes in all.
# Usage: bash benchmarks/gpu_activation_offload.sh [OUT]
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the launcher runs the bench script from benchmarks/
set -uo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
OUT=${1:-${OUT:-outputs/activation-offload}}
mkdir -p "$OUT"
start=$(date +%s)
CAP_GIB=${CAP_GIB:-24}
GPUS=${GPUS:-2}
SEARCH=${SEARCH:-16384,24576,32768,40960,49152,57344,65536,81920}
MODEL=${MODEL:-outputs/llama3-8b} DS_CONFIG=${DS_CONFIG:-recipes/8b/ds_config.json} SEQS=${SEQS:-4096,16384}
# CPU plumbing check: MODEL=assets/tiny/model DS_CONFIG=recipes/tiny/ds_config.json SEQS=128,256 SEARCH=256,512 \
#   TRAIN_BLOCK=128 bash benchmarks/gpu_activation_offload.sh /tmp/ao
(nvidia-smi; free -g; python3 -c "import torch, deepspeed, transformers; print(torch.__version__, torch.version.cuda, deepspeed.__version__, transformers.__version__)"; git rev-parse HEAD) > "$OUT/env.txt" 2>&1
llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape, random weights
elapsed() { echo $(( $(date +%s) - start )); }
port=29611
for mode in $([ "${SKIP_8B:-0}" = 1 ] || echo checkpointing offload); do
  flag=$([ $mode = offload ] && echo --offload)
  port=$((port + 1))
  echo "[$(elapsed) s] 8b $mode" | tee -a "$OUT/progress.txt"
  timeout 210 deepspeed --num_gpus "$GPUS" --master_port $port benchmarks/activation_offload_bench.py \
    --config "$MODEL" --ds-config "$DS_CONFIG" --out "$OUT/8b" $flag --seqs "$SEQS" --steps 5 \
    --search "$SEARCH" --cap-above-rest-gib "$CAP_GIB" --search-budget-s 75 > "$OUT/8b_$mode.log" 2>&1
  echo "[$(elapsed) s] 8b $mode: exit $? (3 = reached an OOM in the search, as intended)" | tee -a "$OUT/progress.txt"
  grep "bench:" "$OUT/8b_$mode.log" | tail -20
  nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/progress.txt" 2>&1
done
if [ "${SKIP_8B:-0}" != 1 ] && [ "$(elapsed)" -lt 360 ]; then
  echo "[$(elapsed) s] hf-zero3 train --activation_offload true" | tee -a "$OUT/progress.txt"
  timeout 110 deepspeed --num_gpus "$GPUS" --master_port $((port + 1)) --module hf_zero3.train recipes/8b/train_args.yaml \
    --model_name_or_path null --config_name "$MODEL" --tokenizer_name assets/tiny/model --deepspeed "$DS_CONFIG" \
    --train_file assets/tiny/corpus/train.txt --block_size "${TRAIN_BLOCK:-4096}" --per_device_train_batch_size 1 \
    --gradient_accumulation_steps 1 --gradient_checkpointing true --gradient_checkpointing_kwargs '{"use_reentrant": false}' \
    --activation_offload true --max_steps 4 --logging_steps 1 --save_strategy no --save_final_model false \
    --output_dir outputs/ao-train --overwrite_output_dir true > "$OUT/train_offload.log" 2>&1
  echo "[$(elapsed) s] train: exit $?" | tee -a "$OUT/progress.txt"
  cp outputs/ao-train/train_log.jsonl "$OUT/train_offload_log.jsonl" 2>/dev/null
  grep -E "activation offload|metrics|Error|error" "$OUT/train_offload.log" | tail -5
fi
if [ "${ONE_GPU_3B:-0}" = 1 ] && [ "$(elapsed)" -lt 300 ]; then
  [ -f outputs/llama-3b/config.json ] || python3 - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
            tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=3).save_pretrained("outputs/llama-3b")
PY
  for mode in checkpointing offload; do
    flag=$([ $mode = offload ] && echo --offload)
    port=$((port + 2))
    timeout 100 deepspeed --num_gpus 1 --master_port $port benchmarks/activation_offload_bench.py \
      --config outputs/llama-3b --out "$OUT/3b" $flag --seqs 4096,16384 --steps 5 > "$OUT/3b_$mode.log" 2>&1
    echo "[$(elapsed) s] 3b $mode: exit $?" | tee -a "$OUT/progress.txt"
  done
fi
free -g >> "$OUT/progress.txt"
echo "[$(elapsed) s] done" | tee -a "$OUT/progress.txt"
[ -d "$OUT/8b" ] && { python3 benchmarks/activation_offload_report.py "$OUT/8b" > "$OUT/summary.md" 2>&1; cat "$OUT/summary.md"; }
if [ -d "$OUT/3b" ]; then python3 benchmarks/activation_offload_report.py "$OUT/3b" > "$OUT/summary_3b.md" 2>&1; fi
