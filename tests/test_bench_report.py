"""``kvshuttle bench report``: benchmarks/README.md's tables are what the committed JSON renders, every committed
JSON is named where a reader looks for it, and the renderer's rows, ratios and errors on small synthetic JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.bench import report
from kvshuttle.cli import main

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "results"


def test_readme_tables_are_what_the_json_renders() -> None:
    tables = report.render(RESULTS)
    readme = (BENCHMARKS / "README.md").read_text()
    assert report.stale_blocks(readme, tables) == [], "run: kvshuttle bench report --write benchmarks/README.md"
    assert all(t.rows for t in tables.values())


def test_every_committed_json_is_named_where_it_is_read() -> None:
    """Current files by the README (a table row or the text), older ones by HISTORY.md: no orphan results."""
    readme = (BENCHMARKS / "README.md").read_text()
    history = (BENCHMARKS / "HISTORY.md").read_text()
    assert [p.name for p in sorted(RESULTS.glob("*.json")) if p.name not in readme] == []
    assert [p.name for p in sorted((RESULTS / "history").glob("*.json")) if p.name not in history] == []
    assert report.current_files(report.render(RESULTS)) <= {p.name for p in RESULTS.glob("*.json")}


def test_the_cli_checks_and_rewrites_a_readme(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- report:plan -->\n<!-- /report -->\n\ntext\n")
    with pytest.raises(SystemExit, match="plan: differs"):
        main(["bench", "report", "--tables", "plan", "--check", str(readme)])
    assert main(["bench", "report", "--tables", "plan", "--write", str(readme)]) == 0
    assert main(["bench", "report", "--tables", "plan", "--check", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n<!-- report:plan -->\n| case |") and text.endswith("<!-- /report -->\n\ntext\n")
    assert "`vm2_plan.json` |" in text


def _pack_row(shape: str, spread: bool = True) -> dict[str, Any]:
    keys = ("pack_vs_copy", "unpack_vs_copy", "pack_vs_peer", "unpack_vs_peer")
    row: dict[str, Any] = {"shape": shape, "device": "cpu", **{k: 1.5 for k in keys}}
    row["ratio_spread"] = {k: ({"min": 1.0, "q1": 1.2, "median": 1.5, "q3": 1.7, "max": 2.25} if spread else None)
                           for k in keys}
    return row


def _write(directory: Path, name: str, doc: dict[str, Any]) -> None:
    (directory / name).write_text(json.dumps(doc))


def test_rows_name_their_json_and_ratios_carry_their_spread(tmp_path: Path) -> None:
    _write(tmp_path, "vm5_pack_cpu.json", {"results": [_pack_row("a"), _pack_row("b")]})
    _write(tmp_path, "h200_pack_cuda.json", {"results": [_pack_row("c", spread=False)]})
    table = report.render(tmp_path, ["pack"])["pack"]
    assert [r.source for r in table.rows] == ["vm5_pack_cpu.json", "vm5_pack_cpu.json", "h200_pack_cuda.json"]
    lines = table.markdown().splitlines()
    assert lines[0] == "| shape | device | pack / memcpy | unpack / memcpy | pack / peer | unpack / peer | JSON |"
    assert lines[2] == "| a | cpu | 1.50 (1.00-2.25) | 1.50 (1.00-2.25) | 1.50 (1.00-2.25) | 1.50 (1.00-2.25) | " \
                       "`vm5_pack_cpu.json` |"
    assert lines[4].startswith("| c | cpu | 1.50 | 1.50 |")  # no rounds kept: a ratio of medians, no min-max
    assert table.rows[0].ratios["pack / memcpy"] == report.Ratio(1.5, 1.0, 2.25)


def test_e2e_ratios_are_peer_time_over_subject_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def row(config: str, ttft: float, turn: float, turn_no: int = 2) -> dict[str, Any]:
        return {"config": config, "case": "main", "first_tokens": 512, "turn": turn_no, "reused_tokens": 500,
                "matches_local_count": "3/3", "seconds": {"prefill_ttft": ttft, "turn": turn}}

    _write(tmp_path, "e.json", {"results": [row("nixl", 2.0, 3.0), row("kvshuttle", 0.5, 2.0),
                                            row("kvshuttle", 9.0, 9.0, turn_no=1)]})
    monkeypatch.setattr(report, "E2E_PAIRS", (("e.json", "kvshuttle", "nixl", ("main",)),))
    (only,) = report.render(tmp_path, ["e2e"])["e2e"].rows
    assert only.ratios == {"TTFT": report.Ratio(4.0), "turn": report.Ratio(1.5)}  # turn 1 is not a row
    assert only.cells == ("main", "512", "kvshuttle / nixl", "500 / 500", "3/3 / 3/3", "4.00", "1.50")

    _write(tmp_path, "e.json", {"results": [row("kvshuttle", 0.5, 2.0)]})
    with pytest.raises(report.ReportError, match=r"e\.json: main 512 turn 2: no row of config 'nixl'"):
        report.render(tmp_path, ["e2e"])


def test_retention_growth_is_time_at_the_largest_over_the_smallest(tmp_path: Path) -> None:
    ops = ("retain", "claim_complete", "renew", "sweep_idle", "sweep_due_per_handle", "retain_evict")
    rows = [{"live_handles": n, "seconds": {op: t for op in ops}} for n, t in ((10**6, 3e-6), (10**4, 2e-6))]
    _write(tmp_path, "vm2_retention.json", {"results": rows})
    table = report.render(tmp_path, ["retention"])["retention"]
    assert table.rows[0].cells == ("retain", "2.00", "3.00", "1.50") and len(table.rows) == 6


@pytest.mark.parametrize(("doc", "message"), [
    ({"result": []}, r"vm2_plan\.json: no field 'results'"),
    ({"results": [{"case": "x", "descriptors": {"native": 3}, "native_vs_peer": 2.0}]},
     r"vm2_plan\.json: results\[0\]: no field 'native_vs_reference'"),
    ({"results": [{"case": "x", "descriptors": {"native": 3}, "native_vs_peer": "fast", "native_vs_reference": 1}]},
     r"field 'native_vs_peer' is 'fast', not a number"),
    ({"results": {"case": "x"}}, r"'results' is not a list of objects"),
])
def test_a_missing_or_wrong_field_is_a_named_error(tmp_path: Path, doc: dict[str, Any], message: str) -> None:
    _write(tmp_path, "vm2_plan.json", doc)
    with pytest.raises(report.ReportError, match=message):
        report.render(tmp_path, ["plan"])


def test_a_missing_file_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(report.ReportError, match=r"vm2_policy\.json: missing"):
        report.render(tmp_path, ["policy"])
    (tmp_path / "vm2_policy.json").write_text("{")
    with pytest.raises(report.ReportError, match="not JSON"):
        report.render(tmp_path, ["policy"])


def test_stale_unknown_and_missing_blocks_are_each_reported() -> None:
    table = report.Table("plan", "t", ("a",), [report.Row("x", ("1.00",), {}, "f.json")])
    fresh = f"<!-- report:plan -->\n{table.markdown()}\n<!-- /report -->\n"
    assert report.stale_blocks(fresh, {"plan": table}) == []
    assert report.stale_blocks(fresh.replace("1.00", "1.01"), {"plan": table}) == [
        "plan: differs from the JSON (kvshuttle bench report --write README)"]
    assert report.stale_blocks("", {"plan": table}) == ["plan: no <!-- report:plan --> block"]
    assert report.stale_blocks(fresh + "<!-- report:nope -->\n<!-- /report -->", {"plan": table})[0].startswith(
        "nope: block names no table")
    assert report.rewrite(fresh.replace("1.00", "1.01"), {"plan": table}) == fresh


def test_plots_draw_one_png_per_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    table = report.Table("plan", "t", ("case", "r"), [
        report.Row("x", ("x", "1.00"), {"r": report.Ratio(1.0, 0.5, 1.5)}, "f.json"),
        report.Row("y", ("y", "2.00"), {"r": report.Ratio(2.0)}, "f.json")])
    (path,) = report.plot({"plan": table}, tmp_path / "plots")
    assert path.name == "plan.png" and path.read_bytes()[:4] == b"\x89PNG"
