#!/usr/bin/env bash
# Regenerate every CPU benchmark JSON in benchmarks/results/, one command each, named <machine>_<bench>.json.
# Earlier machines' files (vm4_*, vm3_*, ..., the *_before and *_repeat runs) are in results/history/, each named
# in benchmarks/HISTORY.md. After a run, point report.TABLES at the new files and regenerate the README's tables:
# kvshuttle bench report --write benchmarks/README.md.
# Usage: bash benchmarks/run_cpu.sh [outdir] [machine]   (defaults: benchmarks/results, vm5; 6-10 minutes on 2 vCPUs)
# The GPU files (h200*) come from benchmarks/gpu_check.sh on a GPU machine.
# vm2_e2e.json needs the vLLM environment: see "End to end in vLLM" in benchmarks/README.md for its command.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
m=${2:-vm5}
mkdir -p "$out"
kvshuttle bench plan --json > "$out/${m}_plan.json"
kvshuttle bench policy --json > "$out/${m}_policy.json"
kvshuttle bench pack --repeat 15 --json > "$out/${m}_pack_cpu.json"
kvshuttle bench transfer --repeat 25 --json > "$out/${m}_transfer.json"
kvshuttle bench transfer --shape pieces --pattern scattered --repeat 25 --json > "$out/${m}_transfer_sweep.json"
kvshuttle bench transfer --blocks 1536 --repeat 9 --json > "$out/${m}_transfer_1536.json"
kvshuttle bench transfer --blocks 4 --repeat 25 --json > "$out/${m}_transfer_small.json"
kvshuttle bench transfer --shape qwen3-32b-tp1 --pattern scattered --chunk-mib 2,16 --json \
  > "$out/${m}_transfer_chunks_tp1.json"
python3 benchmarks/packed_chunk_cost.py 64 10 > "$out/${m}_packed_chunk_cost.json"
python3 benchmarks/packed_bound.py 15 > "$out/${m}_packed_bound.json"
python3 benchmarks/packed_cpu_budget.py 9 > "$out/${m}_packed_cpu_budget.json"
kvshuttle bench transfer --shape qwen3-32b-tp8 --pattern scattered --blocks 1536 --chunk-mib 1,4,16 --depth 2,4 \
  --repeat 5 --json > "$out/${m}_transfer_chunks.json"
kvshuttle bench transfer --shape qwen3-32b-tp1,qwen3-32b-tp2,qwen3-32b-tp4,qwen3-32b-tp8 --pattern scattered \
  --blocks 1536 --repeat 5 --json > "$out/${m}_transfer_pieces.json"
kvshuttle bench retention --json > "$out/${m}_retention.json"
python3 benchmarks/show.py "$out/${m}"_*.json
