#!/usr/bin/env bash
# One-shot GPU check: build with CUDA, run the CUDA and CPU pack tests, run the GPU pack benchmark (end-to-end
# and CUDA-event kernel times, methods interleaved; ~9 rounds of 20 calls per method per shape).
# Usage (on a machine with a GPU, nvcc, torch and the build tools): bash benchmarks/gpu_check.sh [outdir]
set -uo pipefail
out=${1:-${OUT:-/tmp/kvshuttle-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
site=/tmp/kvshuttle-site
rm -rf "$site"
CUDAARCHS=${CUDAARCHS:-90} KVSHUTTLE_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps \
  --target "$site" . 2>&1 | tail -5
export PYTHONPATH=$site
python3 -m kvshuttle.cli info | tee "$out/info.json"
python3 -m pytest -q -p no:cacheprovider tests/test_pack_cuda.py tests/test_pack_cpu.py tests/test_errors.py \
  2>&1 | tee "$out/tests.log" | tail -5
# Copy these two into benchmarks/results/ as h200_pack_cuda.json and h200host_pack_cpu16.json.
python3 -m kvshuttle.cli bench pack --device cuda --repeat 9 --json > "$out/bench_pack_cuda.json"
python3 -m kvshuttle.cli bench pack --device cpu --layers 16 --repeat 5 --json > "$out/bench_pack_cpu16.json"
python3 benchmarks/show.py "$out/bench_pack_cuda.json" "$out/bench_pack_cpu16.json"
