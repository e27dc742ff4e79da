#!/usr/bin/env bash
# Recipe 70b: Llama-2-70B, ZeRO-3 + optimizer offload to CPU + checkpointing; target 8 A100-40GB (1x8 or 2x4). Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target 1x8x40GB "$here" "$@"
