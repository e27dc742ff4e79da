#!/usr/bin/env bash
# Recipe qwen3-30b-a3b: Qwen3-30B-A3B (a mixture of experts: 30.5B parameters, 3.3B active), ZeRO-3 + partial optimizer offload (ratio 0.1) + checkpointing; target 1 node x 8 H100 80GB (dgx-h100). Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target dgx-h100 "$here" "$@"
