#!/usr/bin/env bash
# Wheels the GPU proof needs that the device image lacks (it reaches no package index): NIXL with its CUDA 13
# build, pyzmq, and the build tools at the versions pyproject.toml asks for. Run here, then carry .whl (ignored
# by git) to the device and run benchmarks/gpu_check.sh there. About 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  nixl==1.5.1 nixl-cu13==1.5.1 pyzmq==27.3.0 pybind11==3.1.0 scikit-build-core==1.1.2
du -sh .whl
