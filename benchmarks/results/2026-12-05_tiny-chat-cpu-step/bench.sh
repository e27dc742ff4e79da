#!/usr/bin/env bash
# The tiny recipe's chat run, one process on CPU, 40 steps, in three checkouts interleaved REPEATS times:
#   OLD=worktree-at-78a2bc5 BASE=worktree-at-55962b9 FIX=worktree-of-this-change bash bench.sh OUT REPEATS
# Then: python summarize.py OUT
set -euo pipefail
out=${1:?OUT}; repeats=${2:-3}; here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"
for i in $(seq 1 "$repeats"); do
  for side in old base fix; do
    case $side in old) dir=$OLD;; base) dir=$BASE;; fix) dir=$FIX;; esac
    run="$out/$side-$i"; rm -rf "$run"
    (cd "$dir" && PYTHONPATH="$dir" python "$here/step_clock.py" recipes/tiny/train_args.yaml \
      --train_file assets/tiny/chat/train.jsonl --validation_file assets/tiny/chat/validation.jsonl \
      --block_size 256 --output_dir "$run" --max_steps 40 --save_strategy no > "$run.log" 2>&1)
    echo "$side $i done $(date -u +%T)"
  done
done
