#!/usr/bin/env bash
# Tiny recipe: ZeRO-3 on NUM_GPUS ranks per node with DeepSpeed's launcher.
# On a CPU-only machine the ranks are CPU processes talking over gloo; on a GPU box, one per GPU.
# Usage: recipes/tiny/launch.sh [--key value ...]   (overrides, e.g. --max_steps 20 --output_dir outputs/x)
# Env: NUM_NODES (1), NUM_GPUS (2), MASTER_PORT (a free port), HOSTFILE (multi-node), DEEPSPEED (deepspeed).
set -euo pipefail
cd "$(dirname "$0")/../.."
NUM_NODES=${NUM_NODES:-1}
NUM_GPUS=${NUM_GPUS:-2}
MASTER_PORT=${MASTER_PORT:-$(python -c 'from hf_zero3.distributed import free_port; print(free_port())')}
hostfile=()
[ -n "${HOSTFILE:-}" ] && hostfile=(--hostfile "$HOSTFILE")
exec ${DEEPSPEED:-deepspeed} "${hostfile[@]}" --num_nodes "$NUM_NODES" --num_gpus "$NUM_GPUS" \
  --master_port "$MASTER_PORT" --module hf_zero3.train recipes/tiny/train_args.yaml "$@"
