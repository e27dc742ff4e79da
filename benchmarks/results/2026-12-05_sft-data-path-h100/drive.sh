#!/usr/bin/env bash
# Old (.gpuprev, commit 78a2bc5) against new SFT data path, packed chat, interleaved; LAYERS shrinks the 7B shape to fit.
OUT=$1; LAYERS=${LAYERS:-32}; BUDGET=${BUDGET:-330}
root=$PWD
source .whl/install.sh > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
python3 -c "import torch,transformers,trl,deepspeed,accelerate;print(torch.__version__,transformers.__version__,trl.__version__,deepspeed.__version__,accelerate.__version__)" >> $OUT/gpu.txt 2>&1
echo "layers $LAYERS" >> $OUT/gpu.txt
for side in old new; do
  dir=$root; [ $side = old ] && dir=$root/.gpuprev
  (cd $dir && PYTHONPATH=$dir:$HFZ_SITE python3 benchmarks/packing_bench.py prepare --work /tmp/pk-$side --examples ${EXAMPLES:-400} > /dev/null 2>&1)
  python3 - /tmp/pk-$side/llama2-7b-shape/config.json $LAYERS <<'PY'
import json, sys
p, n = sys.argv[1], int(sys.argv[2]); c = json.load(open(p)); c["num_hidden_layers"] = n; json.dump(c, open(p, "w"), indent=1)
PY
done
S=$SECONDS
for r in 1 2 3; do
  [ $((SECONDS-S)) -lt $BUDGET ] || break
  (cd .gpuprev && PYTHONPATH=$PWD:$HFZ_SITE WORK=/tmp/pk-old VARIANTS=packed:sdpa:2:1 RUN_TIMEOUT=150 bash benchmarks/gpu_packing.sh $OUT/old)
  WORK=/tmp/pk-new VARIANTS=packed:sdpa:2:1 RUN_TIMEOUT=150 bash benchmarks/gpu_packing.sh $OUT/new
done
cat $OUT/gpu.txt
grep -h "real tokens" $OUT/*/packing.md | head
