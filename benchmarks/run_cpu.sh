#!/usr/bin/env bash
# Regenerate every CPU benchmark JSON in benchmarks/results/, one command each, named <machine>_<bench>.json.
# The 2-core VM kind has differed between sessions: vm5_* (a VM reporting the same CPU and L3 as vm4: issue 19's
# sixth session, the lane tuner; vm5_pack_cpu_before.json is main at c501253, vm5_*_repeat.json the same binary
# minutes earlier), vm4_* (2-vCPU AMD EPYC, 32 MiB L3: pack and transfer before and after issue 19's fifth
# session, the piece sweep, 1,536 blocks, the packed pipeline's bound, chunk cost and CPU budget), vm3_* (a VM
# reporting the same CPU, whose copies behaved differently: pack, transfer, small reads, chunk sweeps: issue 19's
# second to fourth sessions), vm2_* (2-vCPU Xeon, 480 MiB L3: everything else), vm2old_* (an earlier VM),
# vm2_pack_cpu_before.json (main's copy code at 7957465), vm3_transfer_small_before.json (main at 0857aa8) and
# vm4_*_before.json (main at 50aeb29) are kept as they are.
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
