#!/usr/bin/env bash
# One device call on the lent H200: GPU tests + op benchmarks, logs under $OUT.
# The GPU box has Python 3.12 and its own packages and no index, so ninfer is put on the path
# through a namespace folder of links instead of a pip install. generated/ and build/cubins travel
# with the call (compiled here on the CPU machine; NVRTC needs no GPU).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
NS=/tmp/ninfer-ns/ninfer; mkdir -p "$NS"
for layer in codegen runtime server cli; do ln -sfn "$ROOT/$layer" "$NS/$layer"; done
export PYTHONPATH=/tmp/ninfer-ns:$ROOT PYTHONUNBUFFERED=1
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; $PY -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda.bindings', cuda.bindings.__version__)"; } 2>&1 | tee "$OUT/env.log"
$PY -m ninfer.codegen 2>&1 | tee "$OUT/generate.log"
$PY -m ninfer.runtime.build --archs sm_90a 2>&1 | tail -2 | tee "$OUT/build.log"
# GEMM routes last and in their own process: a hung or faulting kernel must not hide the other results.
timeout 600 $PY -m pytest -q -m gpu tests/gpu -k "not linear and not graph" -p no:cacheprovider 2>&1 | tee "$OUT/gpu-test-simple.log" | tail -5
timeout 900 $PY -m pytest -q -m gpu tests/gpu -k "linear or graph" -p no:cacheprovider --maxfail=25 --timeout=300 --timeout-method=thread 2>&1 | tee "$OUT/gpu-test-gemm.log" | tail -25
timeout 600 $PY -m ninfer.cli.bench ops ${BENCH_ARGS:-} --json "$OUT/bench-ops.json" 2>&1 | tee "$OUT/bench-ops.log"
