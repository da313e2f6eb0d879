#!/usr/bin/env bash
# The GPU proof of the host tier (issue 35, item 1), one script, about 5 minutes on an H200 with 16 cores:
#   1. build with CUDA (KVSHUTTLE_CUDA=ON, CUDAARCHS=90) into a private site folder;
#   2. tests/test_host_tier_cuda.py: demotions from VRAM caches (cupy and torch) land exactly in pinned host
#      slots, wait for the caller's stream without blocking it, and a tier claim of a GPU owner reads back over
#      real NIXL into VRAM and host readers; then the CPU host-tier tests on the same build;
#   3. `kvshuttle bench transfer --device cuda --host-tier`: the demotion vs one device-to-host copy, the tier's
#      packed read vs the hot cache's direct and packed reads and vs one host-to-device copy, TP1 and TP8 shapes.
# Wheels the device image lacks travel in .whl (benchmarks/gpu_wheels.sh). Usage there: bash benchmarks/gpu_tier_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/kvshuttle-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
start=$(date +%s)
step() { echo "== $1 (at $(( $(date +%s) - start )) s)"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
site=/tmp/kvshuttle-site
rm -rf "$site"
if compgen -G ".whl/*.whl" >/dev/null; then
  step "carried wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl 2>&1 | tail -3
fi
export PYTHONPATH=$site

step "build (CUDA, sm_90)"
pybind11_dir=$(python3 -c "import pybind11; print(pybind11.get_cmake_dir())")
CUDAARCHS=${CUDAARCHS:-90} KVSHUTTLE_CUDA=ON timeout 300 python3 -m pip install -q --no-build-isolation --no-deps \
  --no-compile --target "$site" -C "cmake.define.pybind11_DIR=$pybind11_dir" . > "$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; echo "BUILD FAILED"; exit 1; }
python3 -m kvshuttle.cli info | tee "$out/info.json"

step "tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_host_tier_cuda.py tests/test_host_tier.py 2>&1 \
  | tee "$out/tests.log" | tail -25

step "the CUDA staging pipeline's tests (VRAM packed reads)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda_pipeline.py tests/test_chunk_slots.py 2>&1 \
  | tee "$out/tests_pipeline.log" | tail -5

step "host tier bench (cuda)"
timeout 200 python3 -m kvshuttle.cli bench transfer --device cuda --host-tier --shape qwen3-32b-tp1,qwen3-32b-tp8 \
  --layers 8 --blocks 256 --pattern scattered --repeat 7 --json \
  > "$out/bench_tier_cuda.json" 2> "$out/bench_tier_cuda.err" || tail -30 "$out/bench_tier_cuda.err"
python3 benchmarks/show.py "$out/bench_tier_cuda.json" 2>&1 | tail -12
echo "gpu_tier_check done in $(( $(date +%s) - start )) s"
