#!/usr/bin/env bash
# The CUDA checks in one call on a GPU machine with no network (../shared/gpu/README.md):
# the device-parametrised tests on cuda, the operating points per objective on battery_weld
# (bench_threshold) and the model updates against a full refit (bench_update), both with the
# pretrained EfficientNet-Lite0 on cuda. Everything lands under $OUT (seven files: the device tool brings back eight).
#   prepare here: bash ../shared/gpu/prepare.sh --effnet (bottle at 256 x 256), copy battery_weld
#                 (2.3 MB) into .gpu-data/; the faiss wheel is not needed on cuda
#   run there:    OUT=/some/dir bash benchmarks/gpu_run.sh [tests-seconds]
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__,
  torch.cuda.get_device_name())" 2>&1 | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/device.txt" 2>&1
nproc >> "$OUT/device.txt"
data=.gpu-data/battery_weld
# 1. every test that takes the device fixture, on cuda
start=$(date +%s)
timeout "${1:-130}" python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors \
  -m "not slow" -k cuda tests > "$OUT/tests_cuda.txt" 2>&1
echo "tests rc=$? in $(( $(date +%s) - start )) s" >> "$OUT/tests_cuda.txt"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests_cuda.txt" | tail -15
# 2. operating points per objective (far, f1, recall with 10 labelled defects), both methods
start=$(date +%s)
timeout 150 python3 benchmarks/bench_threshold.py --data "$data" --device cuda \
  --out /tmp/bench_threshold > "$OUT/threshold.txt" 2>&1
echo "threshold rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/threshold.txt"
cp /tmp/bench_threshold/results.json "$OUT/threshold.json" 2>/dev/null
tail -30 "$OUT/threshold.txt"
# 3. updates against a full refit: PaDiM dense and low-rank, PatchCore
for run in "padim_effnet_lite0 dense" "padim_effnet_lite0 lowrank" "patchcore_effnet_lite0 -"; do
  set -- $run
  extra=(); [ "$2" != "-" ] && extra=(padim.covariance=$2)
  start=$(date +%s)
  timeout 70 python3 benchmarks/bench_update.py --data "$data" --config configs/$1.yaml \
    device=cuda data.num_workers=4 "${extra[@]}" > /tmp/update.txt 2>&1
  rc=$?; { echo "## update $1 $2 rc=$rc in $(( $(date +%s) - start )) s"; cat /tmp/update.txt; } \
    | tee -a "$OUT/update.txt" | tail -22
done
# 4. operating points on bottle (shrunk to 256 x 256: the configs resize to 256 anyway)
start=$(date +%s)
timeout 170 python3 benchmarks/bench_threshold.py --data .gpu-data/mvtec_bottle --device cuda \
  --objectives far f1 --out /tmp/bench_threshold_bottle > "$OUT/threshold_bottle.txt" 2>&1
echo "threshold bottle rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/threshold_bottle.txt"
cp /tmp/bench_threshold_bottle/results.json "$OUT/threshold_bottle.json" 2>/dev/null
tail -8 "$OUT/threshold_bottle.txt"
