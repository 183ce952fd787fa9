#!/usr/bin/env bash
# The CUDA checks in one call on a GPU machine with no network (../shared/gpu/README.md):
# the device-parametrised tests on cuda, then bench_pipeline and bench_float16 on cuda with
# the pretrained EfficientNet-Lite0 and the WRN50 configs. Everything lands under $OUT.
#   prepare here: bash ../shared/gpu/prepare.sh --effnet
#   run there:    OUT=/some/dir bash benchmarks/gpu_run.sh [tests-seconds]
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__,
  torch.cuda.get_device_name())" 2>&1 | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/device.txt" 2>&1
data=.gpu-data/mvtec_bottle
# 1. every test that takes the device fixture, on cuda
timeout "${1:-240}" python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m "not slow" -k cuda tests \
  > "$OUT/tests_cuda.txt" 2>&1; echo "tests rc=$?" >> "$OUT/tests_cuda.txt"
tail -5 "$OUT/tests_cuda.txt"
# 2. pipeline speed on cuda (random-init WRN50 times like the pretrained one)
for cfg in padim patchcore; do
  timeout 120 python3 benchmarks/bench_pipeline.py --config configs/$cfg.yaml --data "$data" \
    --device cuda --repeats 30 --json "$OUT/pipeline_$cfg.json" > "$OUT/pipeline_$cfg.txt" 2>&1
  echo "pipeline $cfg rc=$?"; tail -25 "$OUT/pipeline_$cfg.txt"
done
# 3. float16 storage on cuda, pretrained EfficientNet-Lite0
timeout 90 python3 benchmarks/bench_float16.py --config configs/patchcore_effnet_lite0.yaml \
  --data "$data" --json "$OUT/float16_patchcore.json" device=cuda > "$OUT/float16.txt" 2>&1
echo "float16 rc=$?"; tail -15 "$OUT/float16.txt"
