#!/usr/bin/env bash
# FP8 smoke on one H200: a 4-layer Llama of hidden 2048 under ZeRO-3 (tiny recipe, bf16, Liger), fp8 + regional
# compile first, then regional compile alone; 12 steps each.
set -uo pipefail
log=$OUT/log.txt
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$log" 2>&1
source .whl/install.sh >> "$log" 2>&1 || { echo install failed >> "$log"; exit 3; }
python3 -c "import torchao, peft, liger_kernel; print('torchao', torchao.__version__, 'peft', peft.__version__)" >> "$log" 2>&1
shape="hidden_size=2048,intermediate_size=5632,num_hidden_layers=4,num_attention_heads=16,num_key_value_heads=4,head_dim=128,max_position_embeddings=2048"
for v in fp8 rc; do
  extra=(); [ "$v" = fp8 ] && extra=(--fp8 true)
  timeout "${T:-110}" deepspeed --num_gpus 1 --module hf_zero3.train recipes/tiny/train_args.yaml \
    --config_overrides "$shape" --block_size 1024 --bf16 true --use_liger_kernel true --per_device_train_batch_size 8 \
    --max_steps 12 --logging_steps 1 --save_strategy no --save_final_model false --validation_file null \
    --regional_compile true "${extra[@]}" --output_dir /tmp/smoke-$v > "$OUT/$v.log" 2>&1
  echo "$v exit $?" >> "$log"
  cp /tmp/smoke-$v/train_log.jsonl "$OUT/$v.jsonl" 2>/dev/null
  grep -E "hf_zero3: (fp8|regional)|Error" "$OUT/$v.log" | head -5 >> "$log"
  python3 - "$OUT/$v.jsonl" >> "$log" 2>&1 <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = sorted({k for r in rows for k in r if "token" in k or "mfu" in k or k == "loss"})
print(keys)
tps = [r[k] for r in rows for k in r if k.startswith("tokens_per_s") and isinstance(r[k], (int, float))]
print("tokens/s after 4:", tps[4:], "median", statistics.median(tps[4:]) if len(tps) > 4 else None)
print("loss:", [r.get("loss") for r in rows if "loss" in r])
PY
done
