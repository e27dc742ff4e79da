#!/usr/bin/env bash
# Recipe tiny: ZeRO-3 on 2 ranks (CPU processes over gloo without GPUs), from the repository root. Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target 1x2 "$here" "$@"
