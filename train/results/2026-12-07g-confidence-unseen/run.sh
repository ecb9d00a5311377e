#!/bin/sh
# The shipped DSpark drafter's confidence head refit on ShareGPT conversations no drafter here has
# seen (first turns of 193-384 tokens: every data folder before took first turns of at most 192),
# then calibrated again on all 439 validation prompts. Backbone, Markov head and vocabulary stay
# frozen, so the drafts and tau are the shipped drafter's.
set -e
mkdir -p runs/conf-long
echo "== data $(date -u +%T)"
.venv/bin/python -m train.data --out data/smollm2-135m-long --min-prompt-tokens 193 --max-prompt-tokens 384 \
  --conversations 1408 > runs/conf-long/data.log 2>&1
echo "== features $(date -u +%T)"
/usr/bin/time -f "features %e s" .venv/bin/python -m train.features --data data/smollm2-135m-long \
  > runs/conf-long/features.log 2>&1
echo "== fit $(date -u +%T)"
# --seq-len 640: prompt (up to 384) and response (up to 256) whole, every assistant token supervised.
/usr/bin/time -f "fit %e s" .venv/bin/python -m train.fit --config train/configs/dspark_confidence.py \
  --data data/smollm2-135m-long --first-shard 0 --train-shards None --seq-len 640 --steps 200 --warmup-steps 10 \
  --eval-every 50 --save-every 100 --out runs/conf-long/fit > runs/conf-long/fit.log 2>&1
echo "== calibrate $(date -u +%T)"
/usr/bin/time -f "calibrate %e s" .venv/bin/python -m train.calibrate --drafter runs/conf-long/fit/drafter \
  --max-prompts 439 --max-new-tokens 256 > runs/conf-long/calibrate.log 2>&1
echo "== done $(date -u +%T)"
