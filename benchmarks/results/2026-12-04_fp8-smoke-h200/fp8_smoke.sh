#!/usr/bin/env bash
# FP8 smoke on one GPU, from the repository root: OUT=DIR bash benchmarks/results/2026-12-04_fp8-smoke-h200/fp8_smoke.sh
# A 4-layer Llama of hidden 2048 under ZeRO-3 (the tiny recipe, bf16), each run under a timeout of T (110) seconds:
#   fp8       fp8 + regional compile, every Liger kernel inside the layers (rows 1-2 of report.md: the Liger config
#   rc        regional compile alone, the same      is explicit here: compiled layers now default to Liger's loss)
#   fp8_loss  fp8 + regional compile, Liger's fused linear cross-entropy only (row 3)
set -uo pipefail
source benchmarks/common.sh || exit 1  # the GPU box's set-up (.whl/install.sh where the checkout carries one)
log=$OUT/log.txt
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > "$log" 2>&1
python3 -c "import torchao, peft; print('torchao', torchao.__version__, 'peft', peft.__version__)" >> "$log" 2>&1
shape="hidden_size=2048,intermediate_size=5632,num_hidden_layers=4,num_attention_heads=16,num_key_value_heads=4"
shape+=",head_dim=128,max_position_embeddings=2048"
all='{"fused_linear_cross_entropy":true,"cross_entropy":false,"rms_norm":true,"swiglu":true,"rope":true}'
loss='{"fused_linear_cross_entropy":true,"cross_entropy":false,"rms_norm":false,"swiglu":false,"rope":false}'
for v in fp8 rc fp8_loss; do
  case $v in
    fp8) extra=(--fp8 true --liger_kernel_config "$all") ;;
    rc) extra=(--liger_kernel_config "$all") ;;
    fp8_loss) extra=(--fp8 true --liger_kernel_config "$loss") ;;
  esac
  timeout "${T:-110}" deepspeed --num_gpus 1 --module hf_zero3.train recipes/tiny/train_args.yaml \
    --config_overrides "$shape" --block_size 1024 --bf16 true --use_liger_kernel true --per_device_train_batch_size 8 \
    --max_steps 8 --logging_steps 1 --save_strategy no --save_final_model false --validation_file null \
    --regional_compile true "${extra[@]}" --output_dir "/tmp/smoke-$v" > "$OUT/$v.log" 2>&1
  echo "$v exit $?" >> "$log"
  grep -v triton_kernel_wrap "$OUT/$v.log" | grep -E "hf_zero3: (fp8|regional)|AcceleratorError|'loss'" >> "$log"
done
