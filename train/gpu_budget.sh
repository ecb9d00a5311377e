#!/usr/bin/env bash
# The GPU-budget drafters: one time-boxed pass of the training pipeline on a single accelerator.
#
#   bash train/gpu_budget.sh OUT_DIR [SECONDS]
#
# Stages, each bounded by the clock so the whole run ends inside SECONDS (default 570):
#   1. the default model's data extended to every usable ShareGPT record (train.data --waves: a
#      full batch of slots at a time, a few fixed shapes; resumable: the committed full shards are
#      kept, only new conversations are generated), in data/smollm2-135m-gpu, while FEATURE_PROCS
#      processes compute the target features of the kept shards beside it;
#   2. the features of everything else (train.features --parts: the pass is host-bound, so
#      several processes share the one device), validation first, then those of the train split
#      of EXTRA (the committed later-turn data, train.data --turns later) while time is left;
#   3. DSpark, DFlash and EAGLE-3 trained side by side (three train.fit processes on the one device),
#      on EXTRA's train split too (--extra-data) when all its features were made, for the same
#      number of steps S, the most that fits the time left at the measured step rate
#      (STEP_SECONDS, or benchmarks/bench_train.py run during stage 1), at most MAX_EPOCHS (12)
#      passes over the train split: the second budget's validation losses turned up after 13;
#   4. STS calibration of the DSpark drafter on the validation split (train.calibrate --waves).
# Data generation and features run with full float32 matmuls (the target's own greedy output, as on
# CPU); the drafters train at the backend's default precision. What is written to OUT_DIR:
# the new token shards (data.tgz), the three drafters (drafters.tar.part-*, split under 16 MB),
# logs and curves (results.tgz), and this script's log.
#
# Environment knobs: CONVERSATIONS=0 skips the data generation (the committed data as is); SLOTS
# (512) is its batch; DATA_END / FEATURES_END are the seconds at which those stages are stopped;
# FEATURE_PROCS (4) the feature processes; GEN_XLA_FLAGS the XLA_FLAGS of both stages (default: no
# GPU autotuning, to keep their compiles short); STEP_SECONDS=s skips the benchmark and sizes the
# steps from s, the seconds of one step of each drafter together when the three share the device
# (H200, 16 x 384: 0.027-0.031); MARGIN (1.2) divides the steps for safety; MIN_STEPS / MAX_STEPS
# bound them; CALIBRATE_SECONDS (100) is kept for stage 4 and CALIBRATE_PROMPTS (512) bounds it;
# FEATURES_ON_DISK=1 keeps features off /dev/shm; EXTRA (data/smollm2-135m-later; empty: none) is the
# extra train.data folder. The H200 runs and what each stage cost:
# train/results/2026-12-04-gpu-budget/README.md and train/results/2026-12-04-gpu-budget-2/README.md.
set -u
OUT=${1:?usage: bash train/gpu_budget.sh OUT_DIR [SECONDS]}
BUDGET=${2:-570}
PY=${PYTHON:-python3}
SRC=${SRC:-data/smollm2-135m}
DATA=${DATA:-data/smollm2-135m-gpu}
EXTRA=${EXTRA-data/smollm2-135m-later}
[ -n "$EXTRA" ] && [ ! -f "$EXTRA/meta.json" ] && EXTRA=""
RUNS=${RUNS:-runs/gpu}
CONVERSATIONS=${CONVERSATIONS:-8413}  # every usable record of the packaged ShareGPT file (192-token prompts)
SLOTS=${SLOTS:-512}
DATA_END=${DATA_END:-200}
FEATURES_END=${FEATURES_END:-330}
FEATURE_PROCS=${FEATURE_PROCS:-4}
GEN_XLA_FLAGS=${GEN_XLA_FLAGS---xla_gpu_autotune_level=0}
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
  tar -czf "$OUT/results.tgz" logs $RUNS/*/log.jsonl $RUNS/*/curves.png $RUNS/bench_train.* \
    $RUNS/dspark/drafter/calibration.* $RUNS/dspark/drafter/reliability.png \
    "$DATA"/meta.json "$DATA"/features/*/features*.json 2>/dev/null
}
pack_drafters() {
  rm -f "$OUT"/drafters.tar.part-*
  ls -d $RUNS/*/drafter >/dev/null 2>&1 && tar -cf - $RUNS/*/drafter | split -b 15M - "$OUT/drafters.tar.part-"
}
features() {  # features ARGS...: FEATURE_PROCS processes splitting the shards to do; their pids in PIDS
  local i
  PIDS=""
  for i in $(seq 0 $((FEATURE_PROCS - 1))); do
    JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS="$GEN_XLA_FLAGS" timeout "$(until_ "$FEATURES_END")" \
      $PY -m train.features --data "${FEATURE_DATA:-$DATA}" --batch-tokens 8192 --fixed-rows --parts "$FEATURE_PROCS" --part "$i" "$@" \
      >> "logs/features-$i.log" 2>&1 &
    PIDS="$PIDS $!"
  done
}

log "device: $($PY -c 'import jax; print(jax.devices()[0].device_kind, jax.__version__)' 2>&1 | tail -1)"
# The target converted once, before several processes would race to convert it.
$PY -c "from dspark_jax import load_target; t = load_target('smollm2-135m'); print(t.config.num_layers, 'layers')" \
  || { log "the target does not load: stopping"; exit 1; }

[ -d "$DATA/train" ] || { mkdir -p "$DATA" && cp -r "$SRC"/. "$DATA"; }
# Features go to /dev/shm when it has room: the pass writes about 7 KB a token, and the training
# processes read them back through the page cache either way.
if [ -z "${FEATURES_ON_DISK:-}" ] && [ ! -e "$DATA/features" ] && \
   [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -gt $((40 * 1024 * 1024)) ] 2>/dev/null; then
  mkdir -p /dev/shm/dspark-features && ln -s /dev/shm/dspark-features "$DATA/features" && log "features in /dev/shm"
  [ -n "$EXTRA" ] && [ ! -e "$EXTRA/features" ] && mkdir -p /dev/shm/dspark-features-extra && \
    ln -s /dev/shm/dspark-features-extra "$EXTRA/features"
fi

# 1. data, with the drafter-step benchmark beside it (its step times, taken with the generation
#    running, are an upper bound on the training rate) and the features of the train shards that
#    generation keeps (the leading full ones: a partial last shard is regenerated).
BENCH=""
[ -n "${STEP_SECONDS:-}" ] || { $PY benchmarks/bench_train.py --data "$SRC" $BENCH_ARGS --json $RUNS/bench_train.json > $RUNS/bench_train.txt 2>&1 & BENCH=$!; }
EARLY=""
rc=0
if [ "$CONVERSATIONS" -gt 0 ]; then
  KEEP=$($PY -c "
from train import data as d
rows = [d.shard_rows(p) for p in d.shard_paths('$DATA', 'train')]
print(next((i for i, r in enumerate(rows) if r != d.DataConfig.shard_size), len(rows)))")
  [ "${KEEP:-0}" -gt 0 ] && { features --splits train --train-shards "$KEEP"; EARLY=$PIDS; }
  log "data: up to $CONVERSATIONS conversations in waves of $SLOTS (features of the $KEEP kept train shards beside it)"
  JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS="$GEN_XLA_FLAGS" timeout "$(until_ "$DATA_END")" $PY -m train.data \
    --out "$DATA" --conversations "$CONVERSATIONS" --slots "$SLOTS" --rounds-per-step 16 --waves > logs/data.log 2>&1
  rc=$?
fi
if [ $rc -ne 0 ]; then  # stopped early: the finished shards are the data
  log "data: exit $rc; closing the data at the finished shards"
  timeout 60 $PY -m train.data --out "$DATA" --conversations "$CONVERSATIONS" --finalize-only >> logs/data.log 2>&1
fi
log "$($PY -c "import json; m = json.load(open('$DATA/meta.json')); print('data:', m['sequences'], m['assistant_tokens'])")"
pack_data

# 2. features of everything else, validation first (the trainer's validation losses need it).
[ -n "$EARLY" ] && wait $EARLY
log "features: the rest"
features --splits validation train
wait $PIDS
SHARDS=$($PY -c "
import itertools
from train import data as d, features as f
done = lambda split, p: f.shard_done('$DATA', f.FeaturesConfig.layers, split, p)
if not all(done('validation', p) for p in d.shard_paths('$DATA', 'validation')):
    print(0)  # the trainer reads every validation shard
else:  # the finished train shards in order from the first
    print(sum(1 for _ in itertools.takewhile(bool, (done('train', p) for p in d.shard_paths('$DATA', 'train')))))")
TOTAL=$(ls "$DATA"/train/shard-*.npz | wc -l)
log "features: $SHARDS of $TOTAL train shards"
[ "${SHARDS:-0}" -gt 0 ] || { log "no features: stopping"; pack_results; exit 1; }
SHARD_FLAG=""
[ "$SHARDS" -lt "$TOTAL" ] && SHARD_FLAG="--train-shards $SHARDS"
# The extra folder only when every --data shard has its features and time is left before FEATURES_END:
# the trainer reads all of an extra folder's train shards.
EXTRA_FLAG=""
EXTRA_ROWS=0
if [ -n "$EXTRA" ] && [ -z "$SHARD_FLAG" ] && [ "$(until_ "$FEATURES_END")" -gt 5 ]; then
  log "features: $EXTRA"
  FEATURE_DATA="$EXTRA" features --splits train
  wait $PIDS
  if $PY -c "
from train import data as d, features as f
raise SystemExit(not all(f.shard_done('$EXTRA', f.FeaturesConfig.layers, 'train', p) for p in d.shard_paths('$EXTRA', 'train')))"; then
    EXTRA_FLAG="--extra-data $EXTRA"
    EXTRA_ROWS=$($PY -c "from train import data as d; print(sum(d.shard_rows(p) for p in d.shard_paths('$EXTRA', 'train')))")
  fi
  log "features: extra data ${EXTRA_FLAG:-not used (unfinished)}, $EXTRA_ROWS rows"
fi

# 3. the three drafters, same steps each.
[ -n "$BENCH" ] && { kill $BENCH 2>/dev/null; wait $BENCH 2>/dev/null; }
STEPS=$($PY -c "
import json
finish, compile_s, margin = $BUDGET - 40 - ${CALIBRATE_SECONDS:-100}, 35, ${MARGIN:-1.2}
avail = finish - $SECONDS - compile_s
# At most MAX_EPOCHS passes over the rows trained on (16 a step: the configs' batch).
rows = ($SHARDS * 128 if '$SHARD_FLAG' else json.load(open('$DATA/meta.json'))['sequences']['train']) + $EXTRA_ROWS
epochs_cap = int(${MAX_EPOCHS:-12} * rows / 16)
try:
    per_round = float('${STEP_SECONDS:-}') if '${STEP_SECONDS:-}' else sum(
        json.load(open('$RUNS/bench_train.json'))['step_seconds'].values())
except (OSError, ValueError, KeyError):
    per_round = 0.25  # no measurement: a guess that keeps the run inside the budget
print(max(${MIN_STEPS:-200}, min(${MAX_STEPS:-12000}, epochs_cap, int(avail / (per_round * margin))) // 100 * 100))")
WARMUP=$((STEPS / 20))
log "fit: $STEPS steps each (warmup $WARMUP), $(left) s left"
for kind in dspark dflash eagle3; do
  $PY -m train.fit --config train/configs/$kind.py --data "$DATA" --out $RUNS/$kind --steps "$STEPS" \
    --warmup-steps "$WARMUP" --eval-every $((STEPS / 10)) --save-every "$STEPS" $SHARD_FLAG $EXTRA_FLAG $FIT_EXTRA \
    > logs/fit-$kind.log 2>&1 &
  eval "FIT_$kind=\$!"
done
for kind in dspark dflash eagle3; do  # a last resort: a fit killed here exports nothing
  pid_var=FIT_$kind
  (sleep "$(until_ $((BUDGET - 25)))"; kill "${!pid_var}" 2>/dev/null) &
done
wait "$FIT_dspark" "$FIT_dflash" "$FIT_eagle3"
log "fit: done, $(left) s left"
pack_drafters
pack_results

# 4. STS calibration in waves (a few fixed shapes; lazily compiled buckets made it compile-bound).
if [ -d $RUNS/dspark/drafter ] && [ "$(left)" -gt 45 ]; then
  timeout "$(until_ $((BUDGET - 10)))" $PY -m train.calibrate --drafter $RUNS/dspark/drafter --data "$DATA" \
    --max-prompts "${CALIBRATE_PROMPTS:-512}" --slots 256 --waves > logs/calibrate.log 2>&1
  rc=$?
  log "calibrate: exit $rc"
  [ $rc -eq 0 ] && pack_drafters  # a calibration stopped mid-save would leave a broken checkpoint
  pack_results
fi
kill $(jobs -p) 2>/dev/null
log "done"
