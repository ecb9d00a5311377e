#!/bin/sh
# Fine-tune the three shipped drafters on data they never saw (same flags for each).
set -e
while pgrep -f "train.features" >/dev/null; do sleep 10; done
for k in dspark dflash eagle3; do
  echo "== $k $(date -u +%T)"
  /usr/bin/time -f "$k %e s" .venv/bin/python -m train.fit --config train/configs/$k.py --init-from smollm2-135m-$k \
    --first-shard 31 --extra-data data/smollm2-135m-later --steps 600 --warmup-steps 30 --lr 3e-4 \
    --eval-every 100 --save-every 100 --out runs/ft/$k > runs/ft/$k.log 2>&1
  echo "== $k done $(date -u +%T)"
done
