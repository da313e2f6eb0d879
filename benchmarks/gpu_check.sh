#!/usr/bin/env bash
# The GPU proof of issue 20, one script, about 6-8 minutes on an H200 with 16 cores:
#   1. build with CUDA (KVSHUTTLE_CUDA=ON, CUDAARCHS=90) into a private site folder;
#   2. the CUDA tests (kernels vs the numpy reference, the upload ring, the CUDA executor, packed VRAM reads) and
#      the CPU tests of the pipeline's bookkeeping;
#   3. the GPU pack bench: TP1 and TP8 shapes of Qwen3-32B, end to end vs a device-to-device copy, kernel time
#      from CUDA events (in the JSON);
#   4. the two-process VRAM transfer bench (NIXL/UCX on the one GPU, every method's bytes verified): packed vs
#      direct at 4 KiB (TP8) and 32 KiB (TP1) scattered pieces, and vs one contiguous VRAM READ of the same bytes;
#   5. one table of the targets (benchmarks/gpu_table.py).
# Each step has its own time limit, so one that hangs still leaves the others' results.
# Wheels the device image lacks (NIXL, pyzmq, build tools) travel in .whl: run benchmarks/gpu_wheels.sh first and
# carry .whl. Usage on the GPU machine: bash benchmarks/gpu_check.sh [outdir]
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
# pybind11's CMake files from the importable pybind11 (the carried 3.x), not whatever the image has installed.
pybind11_dir=$(python3 -c "import pybind11; print(pybind11.get_cmake_dir())")
CUDAARCHS=${CUDAARCHS:-90} KVSHUTTLE_CUDA=ON timeout 300 python3 -m pip install -q --no-build-isolation --no-deps \
  --no-compile --target "$site" -C "cmake.define.pybind11_DIR=$pybind11_dir" . > "$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log"; echo "BUILD FAILED"; exit 1; }
python3 -m kvshuttle.cli info | tee "$out/info.json"

step "tests"
xdist=""
python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
# shellcheck disable=SC2086
timeout 240 python3 -m pytest -q -p no:cacheprovider $xdist tests/test_pack_cuda.py tests/test_cuda_pipeline.py \
  tests/test_chunk_slots.py 2>&1 | tee "$out/tests.log" | tail -15

step "pack bench (cuda)"
timeout 150 python3 -m kvshuttle.cli bench pack --device cuda --repeat 7 --json \
  > "$out/bench_pack_cuda.json" 2> "$out/bench_pack_cuda.err" || tail -20 "$out/bench_pack_cuda.err"

step "transfer bench (VRAM, two processes)"
timeout 200 python3 -m kvshuttle.cli bench transfer --device cuda --shape qwen3-32b-tp1,qwen3-32b-tp8 --layers 8 \
  --blocks 256 --repeat 7 --chunk-mib 16 --depth 4 --json \
  > "$out/bench_transfer_cuda.json" 2> "$out/bench_transfer_cuda.err" || tail -20 "$out/bench_transfer_cuda.err"

step "results"
python3 benchmarks/show.py "$out/bench_pack_cuda.json" "$out/bench_transfer_cuda.json" 2>/dev/null
echo
python3 benchmarks/gpu_table.py "$out" | tee "$out/table.txt"
echo "gpu_check done in $(( $(date +%s) - start )) s"
