#!/bin/sh
# Deeper-backbone experiment: the shipped 1-layer DSpark continued 400 steps as is (control) and
# grown to 2 layers (new layer starts as the identity), same data and flags as the code fine-tune.
set -e
for spec in "dspark-2l 2" "dspark-1l 1"; do
  set -- $spec
  echo "== $1 $(date -u +%T)"
  /usr/bin/time -f "$1 %e s" .venv/bin/python -m train.fit --config train/configs/dspark.py --init-from smollm2-135m-dspark \
    --num-layers $2 --first-shard 50 --train-shards 8 --extra-data data/smollm2-135m-code --steps 400 --warmup-steps 20 \
    --lr 3e-4 --eval-every 100 --save-every 100 --out runs/grow/$1 > runs/grow/$1.log 2>&1
done
echo "== eval $(date -u +%T)"
/usr/bin/time -f "eval %e s" .venv/bin/python -m train.evaluate runs/grow/dspark-2l/drafter runs/grow/dspark-1l/drafter \
  --datasets mtbench humaneval sharegpt --temperatures 0 --block-sizes 7 --max-prompts 40 --max-new-tokens 64 \
  --speed-batches --out runs/grow/eval-40 > runs/grow/eval-40.log 2>&1
echo "== done $(date -u +%T)"
