#!/usr/bin/env bash
# Recipe 8b against stock HF tuned by hand, every config on the same machine (benchmarks/results/*_8b-tuned/), from the repository
# root on a 2-GPU box: a Llama-3-8B-shaped model with random weights (no download), sequence 4096, bf16, global
# batch 12 x 4096 tokens for every config, 3 runs of each, interleaved:
#   ours         recipe 8b v2 (written again from v1 or v2: the recipe's ZeRO-3 config + Liger, micro 3 x 2)
#   zero2_liger  candidate: ds_configs/zero2.json (the generator's ZeRO-2) + Liger, micro 2 x accumulation 3
#   stock_tuned, zero2_tuned, fsdp2_tuned   stock HF by hand: since the baselines became the competent user's
#     (hf_zero3/ops/baselines.py: Liger on, checkpointing off and on, micro batch searched), the settings below are the
#     report's micro batches without checkpointing, as search starts; add --tuned NAME=M+ckpt for the other half
# Both candidates are written from recipes/8b and the generator, so the winner becomes the recipe unchanged.
# A call cut short is continued with --resume and the same WORK_DIR (same machine).
# Usage: bash benchmarks/gpu_tuned_8b.sh [OUT_DIR [WORK_DIR [--resume]]]
# ZERO2_LIGER=0 leaves the ZeRO-2 candidate out (12 runs instead of 15). ZERO2_LIGER_MICRO=M runs it
# at micro M x accumulation 6/M (default 2; M=1 is named zero2_liger_m1, so its runs never mix with micro 2's).
# Arguments after WORK_DIR go to `hf-zero3 bench` after the script's own (the last --repeats/--against wins; --only
# runs a subset with --resume): split a long comparison into calls on one warm machine with them,
#   bash benchmarks/gpu_tuned_8b.sh OUT WORK --resume --repeats 2 --only zero2_tuned,fsdp2_tuned
# Smoke test on one GPU (checks the plumbing, not the speed): GPUS=1 TRAIN_OVERRIDES="--config_overrides
# num_hidden_layers=4" bash benchmarks/gpu_tuned_8b.sh OUT WORK
set -euo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, scratch_dir, llama3_8b_config
out=${1:-benchmarks}
work=${2:-outputs/bench-8b-tuned}
shift $(( $# < 2 ? $# : 2 ))
llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape, random weights
z2_micro=${ZERO2_LIGER_MICRO:-2}
case $z2_micro in 1|2|3|6) ;; *) echo "ZERO2_LIGER_MICRO must divide 6 (1, 2, 3 or 6), got $z2_micro" >&2; exit 2;; esac
z2_name=zero2_liger$([ "$z2_micro" = 2 ] || echo "_m$z2_micro")
Z2_MICRO=$z2_micro python3 - <<'PY'
import os
import re
import shutil
from pathlib import Path

from hf_zero3.config.build import build_ds_config
from hf_zero3.config.presets import RECIPE_CONFIGS, STANDALONE_CONFIGS, render
from hf_zero3.ops.bench import scratch_run_dir

for name, spec, micro, accum in (("8b-zero3-liger", RECIPE_CONFIGS["8b"], 3, 2),
                                 ("8b-zero2-liger", STANDALONE_CONFIGS["zero2"], int(os.environ["Z2_MICRO"]),
                                  6 // int(os.environ["Z2_MICRO"]))):
    folder = Path("outputs/recipes") / name
    scratch_run_dir(folder)  # emptied only if a run of this script made it
    shutil.copytree("recipes/8b", folder)
    (folder / "ds_config.json").write_text(render(build_ds_config(spec)))
    text = (folder / "train_args.yaml").read_text()
    text, n1 = re.subn(r"(?m)^per_device_train_batch_size: \d+$", f"per_device_train_batch_size: {micro}", text)
    text, n2 = re.subn(r"(?m)^gradient_accumulation_steps: \d+$", f"gradient_accumulation_steps: {accum}", text)
    text, n3 = re.subn(r"(?m)^use_liger_kernel: \w+$", "use_liger_kernel: true", text)
    if not n3:
        text, n3 = re.subn(r"(?m)^gradient_checkpointing: false$", "gradient_checkpointing: false\nuse_liger_kernel: true",
                           text)
    assert (n1, n2, n3) == (1, 1, 1), (name, n1, n2, n3)
    (folder / "train_args.yaml").write_text(text)
PY
python3 -m hf_zero3 bench outputs/recipes/8b-zero3-liger --label llama3-8b --suffix tuned \
  --steps 4 --warmup 1 --repeats 3 --run-timeout 240 \
  --against stock_tuned,zero2_tuned,fsdp2_tuned --tuned stock_tuned=2 --tuned zero2_tuned=1 --tuned fsdp2_tuned=2 --gpus "${GPUS:-2}" \
  $([ "${ZERO2_LIGER:-1}" = 0 ] || echo --variant "$z2_name=outputs/recipes/8b-zero2-liger") \
  --out "$out" --work-dir "$work" "$@" -- \
  --model_name_or_path null --config_name outputs/llama3-8b --tokenizer_name assets/tiny/model \
  --train_file assets/tiny/corpus/train.txt ${TRAIN_OVERRIDES:-}
