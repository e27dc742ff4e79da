#!/usr/bin/env bash
# Recipe 8b: Llama-3-8B, ZeRO-3 bf16; target 1 node x 2 H200 (measured: benchmarks/). Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target 1x2x140GiB "$here" "$@"
