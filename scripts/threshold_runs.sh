#!/bin/bash
# Issue 16 accuracy table: hold-out vs all-images, each with the 1 % tail-model threshold, both
# methods, on bottle and battery_weld; then `python scripts/threshold_table.py $OUT` (which adds
# the hold-out with the quantile + margin rule of before, from the stored good scores).
# BACKBONES="effnet wrn50" (default: effnet only; the random-init WRN50 rows take ~5x longer).
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-eval_threshold}
B=${BOTTLE:-../shared/data/mvtec_bottle}; W=${WELD:-../shared/data/battery_weld}
mkdir -p "$OUT"
run() { # name config [overrides...]
  local name=$1 cfg=$2; shift 2
  [ -f "$OUT/$name/results.json" ] && return
  echo "== $name $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  /usr/bin/time -f "%e s wall, %U+%S s CPU" $PY -W ignore scripts/evaluate.py \
      --config "configs/$cfg.yaml" --data "$B" --data "$W" --out "$OUT/$name" --no-report \
      --quiet device=cpu "$@" > "$OUT/$name.log" 2>&1
  tail -5 "$OUT/$name.log"
}
for bb in ${BACKBONES:-effnet}; do
  for m in padim patchcore; do
    cfg=${m}_effnet_lite0; [ "$bb" = wrn50 ] && cfg=$m
    run "${m}_${bb}_all" "$cfg" threshold.mode=all-images
    run "${m}_${bb}_hold" "$cfg" threshold.mode=holdout
  done
done
echo "done $(date -u +%T)"
