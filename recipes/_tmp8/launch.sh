#!/usr/bin/env bash
# Recipe 8b-dpo: DPO of Llama-3-8B + LoRA r 16, ZeRO-2 bf16, no offload; target 1 x H200 (planned). Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target h200x1 "$here" "$@"
