#!/usr/bin/env bash
# Recipe 10b-h200x1: a 10.7B Llama (SOLAR-10.7B's shape), ZeRO-3 + partial optimizer offload (ratio 0.4) + checkpointing; target 1 H200 (140 GiB, 125 GiB host). Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target h200x1 "$here" "$@"
