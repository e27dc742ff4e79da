#!/usr/bin/env bash
# Recipe 7b: Llama-2-7B, ZeRO-2 bf16 (the planner's choice); target 1 node x 8 A100-80GB. Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target 1x8x80GB "$here" "$@"
