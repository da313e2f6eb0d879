"""The GPU proof's one table (benchmarks/gpu_check.sh): ``python benchmarks/gpu_table.py OUTDIR``.

Reads OUTDIR/tests.log, bench_pack_cuda.json and bench_transfer_cuda.json and prints each target of issue 20
with the measured median ratio (min-max over rounds) and whether the median meets it. A missing file is a row
saying so, never a silent pass.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

PACK_TARGETS = (("pack_vs_copy", 0.85), ("unpack_vs_copy", 0.85))
TRANSFER_TARGETS = (("packed_vs_direct", 3.0), ("packed_vs_one_read", 0.8))


def _load(path: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded


def _row(what: str, row: dict[str, Any], key: str, target: float | None) -> str:
    value = row.get(key)
    if value is None:
        return f"{what:<50} {'missing':>8}"
    spread = (row.get("ratio_spread") or {}).get(key) or {}
    cell = f"{value:.2f}x ({spread.get('min', value):.2f}-{spread.get('max', value):.2f})"
    verdict = "" if target is None else ("  ok" if value >= target else "  BELOW TARGET")
    goal = "" if target is None else f">= {target:g}x"
    return f"{what:<50} {cell:>20} {goal:>9}{verdict}"


def table(out: Path) -> str:
    lines = []
    log = out / "tests.log"
    summary = [ln for ln in log.read_text().splitlines() if re.search(r"\d+ (passed|failed)", ln)] \
        if log.exists() else []
    lines.append(f"CUDA tests: {summary[-1].strip('= ') if summary else 'no result (see tests.log)'}")
    lines.append(f"{'check':<50} {'median (min-max)':>20} {'target':>9}")
    pack = _load(out / "bench_pack_cuda.json")
    if pack is None:
        lines.append("pack bench: no result (see bench_pack_cuda.err)")
    else:
        for r in pack["results"]:
            for key, target in PACK_TARGETS:
                lines.append(_row(f"{r['shape']} {key} (end to end)", r, key, target))
                lines.append(_row(f"{r['shape']} {key} (kernel, CUDA events)", r, f"{key}_kernel", None))
    transfer = _load(out / "bench_transfer_cuda.json")
    if transfer is None:
        lines.append("transfer bench: no result (see bench_transfer_cuda.err)")
    else:
        for r in transfer["results"]:
            verified = "verified" if all(r["verified"].values()) else "NOT VERIFIED"
            for key, target in TRANSFER_TARGETS:
                scattered_tp8 = r["pattern"] == "scattered" and r["bytes_per_piece"] <= 4096
                lines.append(_row(f"{r['shape']} {r['pattern']} {key} ({verified})", r, key,
                                  target if scattered_tp8 else None))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
