#!/usr/bin/env bash
# LoRA at ZeRO-2 and ZeRO-3 on 2 CPU ranks, bf16: the same adapter training, step for step? (CPU, no GPU needed)
# 1. The tiny recipe trains a base for 100 steps (fp32, 2 ranks; its checkpoint-100 is the base).
# 2. LoRA r 8, alpha 16, dropout 0.05, all-linear on that base, bf16, 60 steps of the shipped chat data (packed, loss
#    on the assistant turns), eval every 20 steps on its validation file: once with ZeRO-2, once with ZeRO-3, and with
#    OLD=<commit> once more with ZeRO-3 from that commit (a git worktree), e.g. the code before ZeRO-3's own linear
#    and the bf16 adapter (OLD_PICK=<commit>: that commit's changes to hf_zero3/ applied on it first). Each run's
#    train_log.jsonl is copied to OUT/<label>.jsonl, its log to OUT/<label>.log.
# Usage, from the repository root (in the venv: `source .venv/bin/activate`):
#   bash benchmarks/cpu_lora_stage_parity.sh OUT [OLD=<commit> in the environment]
# Time: ~2 min for the base, 5-7 min per LoRA run on 2 cores.
set -euo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
work=$(mktemp -d)
root=$(pwd)
trap 'git worktree remove --force "$work/old" 2>/dev/null; rm -rf "$work"' EXIT  # the runs' scratch, even on failure
torchrun --nproc_per_node 2 -m hf_zero3.train recipes/tiny/train_args.yaml --output_dir "$work/base" \
  --save_steps 100 > "$out/base.log" 2>&1
python - "$work" <<'PY'
import json, sys
from hf_zero3.config.build import build_ds_config
from hf_zero3.config.spec import ZeroSpec
for stage in (2, 3):
    with open(f"{sys.argv[1]}/ds{stage}.json", "w") as f:
        json.dump(build_ds_config(ZeroSpec(stage=stage, precision="bf16")), f)
PY
lora() {  # CODE_DIR STAGE LABEL
  (cd "$1" && torchrun --nproc_per_node 2 -m hf_zero3.train recipes/tiny/train_args.yaml \
    --model_name_or_path "$work/base/checkpoint-100" --config_name null --tokenizer_name "$work/base" \
    --peft '{"r": 8, "alpha": 16, "dropout": 0.05}' --deepspeed "$work/ds$2.json" --bf16 true \
    --train_file "$root/assets/tiny/chat/train.jsonl" --validation_file "$root/assets/tiny/chat/validation.jsonl" \
    --block_size 256 --max_steps 60 --logging_steps 5 --eval_strategy steps --eval_steps 20 --save_strategy no \
    --save_final_model false --learning_rate 2e-3 --warmup_steps 5 --output_dir "$work/$3") > "$out/$3.log" 2>&1
  cp "$work/$3/train_log.jsonl" "$out/$3.jsonl"
}
lora "$root" 2 zero2
lora "$root" 3 zero3
if [ -n "${OLD:-}" ]; then
  git worktree add -q "$work/old" "$OLD"
  # OLD_PICK=<commit>: that commit's product code applied on OLD (a fix the run needs, e.g. the packing check's)
  [ -z "${OLD_PICK:-}" ] || git diff "$OLD_PICK^" "$OLD_PICK" -- hf_zero3 | git -C "$work/old" apply
  lora "$work/old" 3 "zero3_$OLD"
fi
python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for log in sorted(out.glob("*.jsonl")):
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    print(log.stem, "train", [round(r["loss"], 4) for r in rows if "loss" in r])
    print(log.stem, "eval", [(r["step"], round(r["eval_loss"], 4)) for r in rows if "eval_loss" in r])
PY
