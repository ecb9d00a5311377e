#!/bin/sh
# Fine-tune the three shipped drafters on code answers (Python standard-library stubs) mixed with
# ShareGPT first turns they saw before (same flags, same steps, same data for each).
set -e
STEPS=${STEPS:-400}
mkdir -p runs/code
.venv/bin/python -m train.data --out data/smollm2-135m-code --source stdlib-code --conversations 1024
.venv/bin/python -m train.features --data data/smollm2-135m --first-shard 50 --train-shards 8 --splits train
.venv/bin/python -m train.features --data data/smollm2-135m --splits validation
.venv/bin/python -m train.features --data data/smollm2-135m-code --splits train
for k in dspark dflash eagle3; do
  echo "== $k $(date -u +%T)"
  /usr/bin/time -f "$k %e s" .venv/bin/python -m train.fit --config train/configs/$k.py --init-from smollm2-135m-$k \
    --first-shard 50 --train-shards 8 --extra-data data/smollm2-135m-code --steps $STEPS --warmup-steps 20 \
    --lr 3e-4 --eval-every 100 --save-every 100 --out runs/code/$k > runs/code/$k.log 2>&1
done
