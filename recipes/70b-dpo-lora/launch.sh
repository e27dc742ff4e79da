#!/usr/bin/env bash
# Recipe 70b-dpo-lora: DPO of Llama-2-70B + LoRA r 16 on the frozen base, ZeRO-3 + checkpointing, no offload; target 8 x A100-80GB (planned). Settings (NUM_NODES, NUM_GPUS, HOSTFILE, MODEL, DRY_RUN, ...): python -m hf_zero3 launch --help
here="$(cd "$(dirname "$0")" && pwd)" && cd "$here/../.." && exec python -m hf_zero3 launch --target dgx-a100-80 "$here" "$@"
