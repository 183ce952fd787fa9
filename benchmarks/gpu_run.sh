#!/usr/bin/env bash
# The CUDA checks in one call on a GPU machine with no network (../shared/gpu/README.md).
# Sections (all by default, or those named in SECTIONS):
#   tests      every test that takes the device fixture, on cuda
#   pipeline   bench_pipeline on cuda, WRN50 PaDiM and PatchCore (bottle at 256 x 256)
#   float16    bench_float16 on cuda, PatchCore EfficientNet-Lite0
#   threshold  bench_threshold on cuda: operating points per objective on battery_weld and bottle
#   update     bench_update on cuda: PaDiM dense and low-rank, PatchCore, against a refit
#   serve      bench_serve on cuda: the eager service under 8 clients (needs the [serve] wheels
#              in .whl/: fastapi starlette uvicorn pydantic pydantic-core python-multipart
#              fastapi-offline annotated-types annotated-doc typing-inspection opentelemetry-api)
#   loop       bench_loop on cuda over the high-resolution set ($MAC, 1500 x 1000): the real
#              service, labels, update from the results log, promote; PaDiM dense (three timed
#              pairs) and PatchCore (one)
#   macaroni   bench_threshold on cuda over $MAC: far and f1 (10 labelled defects), both methods
#   memfmt     bench_memory_format on cuda: contiguous against channels-last, PaDiM
#              EfficientNet-Lite0 and WRN50 on battery_weld (backbone.channels_last: null
#              keeps GPUs contiguous until this shows channels-last faster in float32)
#   fold       bench_memory_format --setting on cuda, PaDiM on battery_weld: the BatchNorms
#              folded into the convolutions or not (EfficientNet-Lite0 and WRN50), the zero
#              padding folded and the activations in place or not (EfficientNet-Lite0: WRN50
#              has nothing of either to rewrite)
# Each writes one text file under $OUT (the device tool brings back at most eight files).
#   prepare here: bash ../shared/gpu/prepare.sh --effnet (bottle at 256 x 256 in .gpu-data/),
#                 then cp -r ../shared/data/battery_weld .gpu-data/ (2.3 MB); for loop and
#                 macaroni cp -r ../shared/data/visa_macaroni1 .gpu-data/ (45 MB: carry it in a
#                 call of its own, .gpu-data/visa_macaroni1, on the machine the wheels went to)
#   run there:    OUT=/some/dir [SECTIONS="tests update"] bash benchmarks/gpu_run.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
SECTIONS=" ${SECTIONS:-tests pipeline float16 threshold update serve} "
# into the interpreter's own site (root there): the servers bench_serve and bench_loop start are
# subprocesses, and a later call on the still-warm machine finds them installed (the wheels
# stay there too; a call that carried none installs nothing)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__,
  torch.cuda.get_device_name())" 2>&1 | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/device.txt" 2>&1
bottle=.gpu-data/mvtec_bottle battery=.gpu-data/battery_weld MAC=${MAC:-.gpu-data/visa_macaroni1}
workers=$(( $(nproc) / 2 ))
has() { [[ "$SECTIONS" == *" $1 "* ]]; }
# run NAME SECONDS COMMAND...: the command's output appended to $OUT/NAME.txt, its end shown
run() {
  local name=$1 limit=$2 start; shift 2; start=$(date +%s)
  { echo "## $*"; timeout "$limit" "$@" 2>&1; echo "## rc=$? in $(( $(date +%s) - start )) s"; } \
    >> "$OUT/$name.txt"
  tail -12 "$OUT/$name.txt"
}
if has tests; then
  run tests 150 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors \
    -m "not slow" -k cuda tests
fi
if has pipeline; then  # random-init WRN50 times like the pretrained one
  for cfg in padim patchcore; do
    run pipeline 120 python3 benchmarks/bench_pipeline.py --config configs/$cfg.yaml \
      --data "$bottle" --device cuda --repeats 30
  done
fi
if has float16; then
  run float16 90 python3 benchmarks/bench_float16.py --config configs/patchcore_effnet_lite0.yaml \
    --data "$bottle" device=cuda
fi
if has threshold; then  # far, f1 and recall with 10 labelled defects; bottle: far and f1
  run threshold 150 python3 benchmarks/bench_threshold.py --data "$battery" --device cuda \
    --out /tmp/thr_battery
  run threshold 170 python3 benchmarks/bench_threshold.py --data "$bottle" --device cuda \
    --objectives far f1 --out /tmp/thr_bottle
fi
if has update; then
  for cov in dense lowrank; do
    run update 70 python3 benchmarks/bench_update.py --data "$battery" \
      --config configs/padim_effnet_lite0.yaml device=cuda data.num_workers=4 padim.covariance=$cov
  done
  run update 70 python3 benchmarks/bench_update.py --data "$battery" \
    --config configs/patchcore_effnet_lite0.yaml device=cuda data.num_workers=4
fi
if has serve; then
  run serve 120 python3 -m anomaly_hooks.cli fit --config configs/patchcore_effnet_lite0.yaml \
    --data "$bottle" output=/tmp/pc.safetensors device=cuda
  run serve 200 python3 benchmarks/bench_serve.py --model /tmp/pc.safetensors \
    --images "$bottle/test" --clients 8 --duration 40 --cycles 1 --reference-passes 1 \
    --out /tmp/bench_serve.json
fi
if has loop; then
  run loop 300 python3 benchmarks/bench_loop.py --data "$MAC" \
    --config configs/padim_effnet_lite0.yaml device=cuda data.num_workers=$workers --repeats 3
  run loop 200 python3 benchmarks/bench_loop.py --data "$MAC" \
    --config configs/patchcore_effnet_lite0.yaml device=cuda data.num_workers=$workers
fi
if has memfmt; then
  for cfg in padim_effnet_lite0 padim; do
    run memfmt 150 python3 benchmarks/bench_memory_format.py --data "$battery" \
      --config configs/$cfg.yaml --fit 37 --predict 128 --repeats 3 device=cuda \
      data.num_workers=$workers
  done
fi
if has fold; then
  for setting in fold_batchnorm fold_padding inplace_activations; do
    for cfg in padim_effnet_lite0 padim; do
      [[ $setting != fold_batchnorm && $cfg == padim ]] && continue
      run fold 120 python3 benchmarks/bench_memory_format.py --data "$battery" \
        --config configs/$cfg.yaml --setting backbone.$setting --fit 37 --predict 128 \
        --repeats 3 device=cuda data.num_workers=$workers
    done
  done
fi
if has macaroni; then
  run macaroni 300 python3 benchmarks/bench_threshold.py --data "$MAC" --device cuda \
    --objectives far f1 --out /tmp/thr_mac
fi
