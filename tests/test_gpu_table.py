"""benchmarks/gpu_table.py: the GPU proof's table says which targets a run met, and never passes a missing one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_table


def _transfer_row(pattern: str, piece: int, packed_vs_direct: float, packed_vs_one_read: float,
                  verified: bool = True) -> dict[str, Any]:
    ratios = {"packed_vs_direct": packed_vs_direct, "packed_vs_one_read": packed_vs_one_read}
    return {"shape": f"qwen3-32b-tp{8 if piece == 4096 else 1}", "pattern": pattern, "bytes_per_piece": piece,
            **ratios, "ratio_spread": {k: {"min": v - 0.1, "max": v + 0.1} for k, v in ratios.items()},
            "verified": {"direct": True, "packed": verified}}


def test_targets_are_judged_on_the_median_and_missing_results_say_so(tmp_path: Path) -> None:
    (tmp_path / "tests.log").write_text("....\n===== 1200 passed, 3 skipped in 91.0s =====\n")
    pack = {"results": [{"shape": "qwen3-32b-tp8", "pack_vs_copy": 0.91, "unpack_vs_copy": 0.80,
                         "pack_vs_copy_kernel": 0.95, "ratio_spread": {"pack_vs_copy": {"min": 0.9, "max": 0.93}}}]}
    (tmp_path / "bench_pack_cuda.json").write_text(json.dumps(pack))
    text = gpu_table.table(tmp_path)
    lines = text.splitlines()
    assert "1200 passed, 3 skipped" in lines[0]
    assert any("pack_vs_copy (end to end)" in ln and "0.91x (0.90-0.93)" in ln and ln.endswith("ok") for ln in lines)
    assert any("unpack_vs_copy (end to end)" in ln and ln.endswith("BELOW TARGET") for ln in lines)
    assert any("unpack_vs_copy (kernel" in ln and "missing" in ln for ln in lines)
    assert "transfer bench: no result" in text

    transfer = {"results": [_transfer_row("scattered", 4096, 3.5, 0.7, verified=False),
                            _transfer_row("scattered", 32768, 1.2, 0.9)]}
    (tmp_path / "bench_transfer_cuda.json").write_text(json.dumps(transfer))
    lines = gpu_table.table(tmp_path).splitlines()
    tp8 = [ln for ln in lines if "tp8 scattered" in ln]
    assert len(tp8) == 2 and all("NOT VERIFIED" in ln for ln in tp8)
    assert tp8[0].endswith("ok") and tp8[1].endswith("BELOW TARGET")
    tp1 = [ln for ln in lines if "tp1 scattered" in ln]
    assert tp1 and not any(ln.endswith(("ok", "TARGET")) for ln in tp1)  # no target at 32 KiB pieces


def test_no_test_log_is_no_result(tmp_path: Path) -> None:
    assert "no result" in gpu_table.table(tmp_path).splitlines()[0]
