#!/usr/bin/env bash
# The GPU-budget drafters: one time-boxed pass of the training pipeline on a single accelerator.
#
#   bash train/gpu_budget.sh OUT_DIR [SECONDS]
#
# Stages, each bounded by the clock so the whole run ends inside SECONDS (default 570):
#   1. the default model's data extended to every usable ShareGPT record (train.data, resumable:
#      the committed shards are kept, only new conversations are generated), in data/smollm2-135m-gpu;
#   2. target features of both splits (train.features; the validation split first);
#   3. DSpark, DFlash and EAGLE-3 trained side by side (three train.fit processes on the one device)
#      for the same number of steps S, the most that fits the time left at the rate
#      benchmarks/bench_train.py measured on this device during stage 1;
#   4. STS calibration of the DSpark drafter (train.calibrate) and, if time is left, the engine's
#      cost table on this device (python -m dspark_jax.schedule).
# Data generation and features run with full float32 matmuls (the target's own greedy output, as on
# CPU); the drafters train at the backend's default precision. What is written to OUT_DIR: the new
# token shards (data.tgz), the three drafters (drafters.tar.part-*, split under 16 MB), logs,
# curves, the benchmark and the calibration report (results.tgz), and this script's log.
#
# Environment knobs: CONVERSATIONS=0 skips stage 1 (the committed data as is); STEP_SECONDS=s skips
# the benchmark and sizes the steps from s, the seconds of one step of each drafter together;
# MIN_STEPS / MAX_STEPS bound the steps; FEATURES_END=t ends the feature pass t seconds in;
# FEATURES_XLA_FLAGS are XLA_FLAGS for it. The 2026-12-04 H200 run and what each stage cost:
# train/results/2026-12-04-gpu-budget/README.md (data generation there was compile-bound: the
# Engine's bucket programs; the XLA cache in ~/.cache/dspark_jax/xla now keeps them for a rerun).
set -u
OUT=${1:?usage: bash train/gpu_budget.sh OUT_DIR [SECONDS]}
BUDGET=${2:-570}
PY=${PYTHON:-python3}
SRC=${SRC:-data/smollm2-135m}
DATA=${DATA:-data/smollm2-135m-gpu}
RUNS=${RUNS:-runs/gpu}
CONVERSATIONS=${CONVERSATIONS:-8413}  # every usable record of the packaged ShareGPT file (192-token prompts)
# Knobs for a dry run of the control flow on a CPU (smaller steps and benchmark); empty on the device.
FIT_EXTRA=${FIT_EXTRA:-}
BENCH_ARGS=${BENCH_ARGS:---sequences 16 --batch-size 16 --seq-len 384 --repeats 3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT" "$RUNS" logs
log() { echo "[$(printf '%4d' "$SECONDS") s] $*"; }
left() { echo $((BUDGET - SECONDS)); }
until_() { local t=$(($1 - SECONDS)); [ "$t" -gt 1 ] && echo "$t" || echo 1; }  # seconds until mark $1

pack_data() { tar -czf "$OUT/data.tgz" --exclude=features "$DATA" 2>/dev/null; }
pack_results() {
  tar -czf "$OUT/results.tgz" logs $RUNS/*/log.jsonl $RUNS/*/curves.png $RUNS/bench_train.* $RUNS/sps-* \
    $RUNS/*/drafter/calibration.md $RUNS/*/drafter/reliability.png 2>/dev/null
}
pack_drafters() {
  rm -f "$OUT"/drafters.tar.part-*
  ls -d $RUNS/*/drafter >/dev/null 2>&1 && tar -cf - $RUNS/*/drafter | split -b 15M - "$OUT/drafters.tar.part-"
}

log "device: $($PY -c 'import jax; print(jax.devices()[0].device_kind, jax.__version__)' 2>&1 | tail -1)"
# The target converted once, before several processes would race to convert it.
$PY -c "from dspark_jax import load_target; t = load_target('smollm2-135m'); print(t.config.num_layers, 'layers')" \
  || { log "the target does not load: stopping"; exit 1; }

# 1. data, with the drafter-step benchmark beside it (its step times, taken with the generation
#    running, are an upper bound on the training rate).
[ -d "$DATA" ] || cp -r "$SRC" "$DATA"
BENCH=""
[ -n "${STEP_SECONDS:-}" ] || { $PY benchmarks/bench_train.py --data "$SRC" $BENCH_ARGS --json $RUNS/bench_train.json > $RUNS/bench_train.txt 2>&1 & BENCH=$!; }
rc=0
if [ "$CONVERSATIONS" -gt 0 ]; then
  log "data: up to $CONVERSATIONS conversations"
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$(until_ 190)" $PY -m train.data --out "$DATA" \
    --conversations "$CONVERSATIONS" --slots 256 --rounds-per-step 16 > logs/data.log 2>&1
  rc=$?
fi
if [ $rc -ne 0 ]; then  # stopped early: the finished shards are the data
  log "data: exit $rc; closing the data at the finished shards"
  timeout 60 $PY -m train.data --out "$DATA" --conversations "$CONVERSATIONS" --finalize-only >> logs/data.log 2>&1
fi
$PY -c "import json; m = json.load(open('$DATA/meta.json')); print('data:', m['sequences'], m['assistant_tokens'])"
pack_data

# 2. features: validation first (the trainer's validation losses need it), then train in order.
log "features"
JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS="${FEATURES_XLA_FLAGS:-}" timeout "$(until_ "${FEATURES_END:-285}")" $PY -m train.features --data "$DATA" \
  --splits validation train --batch-tokens 8192 --fixed-rows > logs/features.log 2>&1
log "features: exit $?"
SHARDS=$($PY - <<EOF
import itertools
from train import data as d, features as f
done = (f.shard_done("$DATA", f.FeaturesConfig.layers, "train", p) for p in d.shard_paths("$DATA", "train"))
print(sum(1 for _ in itertools.takewhile(bool, done)))  # the finished shards in order from the first
EOF
)
TOTAL=$(ls "$DATA"/train/shard-*.npz | wc -l)
log "features: $SHARDS of $TOTAL train shards"
[ "${SHARDS:-0}" -gt 0 ] || { log "no features: stopping"; pack_results; exit 1; }
SHARD_FLAG=""
[ "$SHARDS" -lt "$TOTAL" ] && SHARD_FLAG="--train-shards $SHARDS"

# 3. the three drafters, same steps each.
[ -n "$BENCH" ] && { kill $BENCH 2>/dev/null; wait $BENCH 2>/dev/null; }
STEPS=$($PY - <<EOF
import json, os
finish, compile_s, margin = $BUDGET - 75, 60, 1.4
avail = finish - $SECONDS - compile_s
try:
    per_round = float("${STEP_SECONDS:-}") if "${STEP_SECONDS:-}" else sum(
        json.load(open("$RUNS/bench_train.json"))["step_seconds"].values())
except (OSError, ValueError, KeyError):
    per_round = 0.25  # no measurement: a guess that keeps the run inside the budget
print(max(${MIN_STEPS:-200}, min(${MAX_STEPS:-8000}, int(avail / (per_round * margin)) // 100 * 100)))
EOF
)
WARMUP=$((STEPS / 20))
log "fit: $STEPS steps each (warmup $WARMUP), $(left) s left"
for kind in dspark dflash eagle3; do
  $PY -m train.fit --config train/configs/$kind.py --data "$DATA" --out $RUNS/$kind --steps "$STEPS" \
    --warmup-steps "$WARMUP" --eval-every $((STEPS / 10)) --save-every "$STEPS" $SHARD_FLAG $FIT_EXTRA \
    > logs/fit-$kind.log 2>&1 &
  eval "FIT_$kind=\$!"
done
for kind in dspark dflash eagle3; do
  pid_var=FIT_$kind
  (sleep "$(until_ $((BUDGET - 50)))"; kill "${!pid_var}" 2>/dev/null) &
done
wait "$FIT_dspark" "$FIT_dflash" "$FIT_eagle3"
log "fit: done, $(left) s left"
pack_drafters
pack_results

# 4. calibration of the DSpark drafter, then the cost table if time is left.
if [ -d $RUNS/dspark/drafter ] && [ "$(left)" -gt 40 ]; then
  timeout "$(until_ $((BUDGET - 12)))" $PY -m train.calibrate --drafter $RUNS/dspark/drafter --data "$DATA" \
    --max-prompts 256 --slots 64 > logs/calibrate.log 2>&1
  log "calibrate: exit $?"
  pack_drafters
fi
if [ -d $RUNS/dspark/drafter ] && [ "$(left)" -gt 45 ]; then
  timeout "$(until_ $((BUDGET - 8)))" $PY -m dspark_jax.schedule --drafter $RUNS/dspark/drafter --slots 64 \
    --out $RUNS/sps-h200.json > logs/schedule.log 2>&1
  log "schedule: exit $?"
fi
pack_results
kill $(jobs -p) 2>/dev/null
log "done"
