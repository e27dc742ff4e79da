#!/usr/bin/env bash
# Recipe 70b-lora: Llama-2-70B + LoRA r 16 on the frozen base, ZeRO-3 + checkpointing, no offload; target p4d.24xlarge / ND A100 v4 (8 A100-40GB) or 2 x 4 A100-40GB. Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target p4d.24xlarge "$here" "$@"
