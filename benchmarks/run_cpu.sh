#!/usr/bin/env bash
# Regenerate every CPU benchmark JSON in benchmarks/results/ (the vm2_* files: the 2-core VM), one command each.
# vm2_pack_cpu_before.json (the pack bench over main's copy code at 7957465) and the vm2old_* files (an earlier
# VM) are kept as they are.
# Usage: bash benchmarks/run_cpu.sh [outdir]   (default: benchmarks/results; about 6-10 minutes on 2 vCPUs)
# The GPU files (h200*) come from benchmarks/gpu_check.sh on a GPU machine.
# vm2_e2e.json needs the vLLM environment: see "End to end in vLLM" in benchmarks/README.md for its command.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
kvshuttle bench plan --json > "$out/vm2_plan.json"
kvshuttle bench policy --json > "$out/vm2_policy.json"
kvshuttle bench pack --repeat 15 --json > "$out/vm2_pack_cpu.json"
kvshuttle bench transfer --repeat 25 --json > "$out/vm2_transfer.json"
kvshuttle bench transfer --shape pieces --pattern scattered --repeat 15 --json > "$out/vm2_transfer_sweep.json"
kvshuttle bench transfer --blocks 1536 --repeat 5 --json > "$out/vm2_transfer_1536.json"
kvshuttle bench transfer --shape qwen3-32b-tp8 --pattern scattered --blocks 1536 --chunk-mib 1,4,16 --depth 2,4 \
  --repeat 5 --json > "$out/vm2_transfer_chunks.json"
kvshuttle bench transfer --shape qwen3-32b-tp1,qwen3-32b-tp2,qwen3-32b-tp4,qwen3-32b-tp8 --pattern scattered \
  --blocks 1536 --repeat 5 --json > "$out/vm2_transfer_pieces.json"
kvshuttle bench retention --json > "$out/vm2_retention.json"
python3 benchmarks/show.py "$out"/vm2_*.json
