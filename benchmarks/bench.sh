#!/usr/bin/env bash
# The standard comparison (`make bench`): a recipe as it ships against the stock baselines, one after another on the
# same model, sequence length, global batch and GPUs, one report side by side (`hf-zero3 bench`).
#   RECIPE=8b (default): the Llama-3-8B shape with random weights (no download), sequence 4096, the recipe's batch,
#     against transformers' documented ZeRO-3 template (stock) and the competent user (tuned: stock ZeRO-3, ZeRO-2
#     and FSDP2 with Liger, fused AdamW, checkpointing off and on, each at the best micro batch that fits, searched
#     down on out-of-memory; hf_zero3/ops/baselines.py); 2 x H200 or alike.
#   RECIPE=tiny: the tiny recipe against stock, on CPU or any GPU (a check of the harness, not a speed result).
# Settings: AGAINST (the baselines), GPUS (default 2), STEPS (10), WARMUP (3), REPEATS (1; 3 for a claim: ZeRO-3's
# speed varies run to run), WORK (outputs/bench-<recipe>), TRAIN_OVERRIDES (train arguments for every variant, e.g.
# "--per_device_train_batch_size 1 --gradient_accumulation_steps 4"). Arguments after OUT go to `hf-zero3 bench`.
# Usage, from the repository root: bash benchmarks/bench.sh [OUT [bench arguments]]
#   (default OUT: benchmarks/results/<date>_bench-<recipe>, the shelf's layout)
set -euo pipefail
source benchmarks/common.sh || exit 1  # GPU box set-up, llama3_8b_config
recipe=${RECIPE:-8b}
out=${1:-benchmarks/results/$(date -u +%F)_bench-$recipe}
shift $(( $# > 0 ? 1 : 0 ))
common=(--steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --repeats "${REPEATS:-1}" --gpus "${GPUS:-2}" --out "$out"
        --work-dir "${WORK:-outputs/bench-$recipe}")
case $recipe in
  8b)
    llama3_8b_config  # outputs/llama3-8b: the Llama-3-8B shape, random weights
    python3 -m hf_zero3 bench 8b --label llama3-8b --against "${AGAINST:-stock,tuned}" \
      "${common[@]}" "$@" -- --model_name_or_path null --config_name outputs/llama3-8b \
      --tokenizer_name assets/tiny/model --train_file assets/tiny/corpus/train.txt --block_size 4096 ${TRAIN_OVERRIDES:-} ;;
  tiny)
    python3 -m hf_zero3 bench tiny --against "${AGAINST:-stock}" "${common[@]}" "$@" ${TRAIN_OVERRIDES:+-- $TRAIN_OVERRIDES} ;;
  *)
    echo "error: RECIPE=$recipe: bench.sh runs RECIPE=8b (GPUs) or RECIPE=tiny (CPU too); for another recipe run" \
         "hf-zero3 bench <recipe> --against ... yourself (its model must be there)" >&2
    exit 2 ;;
esac
