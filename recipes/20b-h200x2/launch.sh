#!/usr/bin/env bash
# Recipe 20b-h200x2: a 20.7B Llama, ZeRO-3 + partial optimizer offload (ratio 0.5) + checkpointing; target 1 node x 2 H200 (140 GiB, 256 GiB host). Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target h200x2 "$here" "$@"
