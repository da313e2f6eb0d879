"""``kvshuttle bench demotion``'s pure parts: the window order, splitting the bystanders' gaps by window, the gaps
that met a copy, the decode's copy log lines, the ratios and the table (no vLLM)."""

from __future__ import annotations

from typing import Any

from kvshuttle.bench.e2e import demotion
from kvshuttle.bench.e2e.bystander import summary


def test_window_order_alternates_which_kind_comes_first_across_rounds() -> None:
    assert demotion.window_order(2, 3) == [["demote", "quiet", "quiet", "demote", "demote", "quiet"],
                                           ["quiet", "demote", "demote", "quiet", "quiet", "demote"]]
    order = demotion.window_order(3, 4)
    assert all(r.count("demote") == r.count("quiet") == 4 for r in order)


def test_gaps_are_split_by_the_window_they_ended_in() -> None:
    windows = [("demote", 10.0, 12.0), ("quiet", 12.0, 14.0)]
    gaps = [(9.99, 10.02), (11.0, 11.5), (12.5, 12.53), (14.0, 14.1), (1.0, 1.1)]
    split = demotion.split_gaps(gaps, windows)
    assert [round(x, 6) for x in split["demote"]] == [30.0, 500.0]
    assert [round(x, 6) for x in split["quiet"]] == [30.0]  # (14.1 ended after every window; 1.1 before)


def test_touched_gaps_overlap_a_span() -> None:
    gaps = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]
    assert demotion.touched(gaps, [(1.5, 2.5)]) == [1000.0, 1000.0]
    assert demotion.touched(gaps, [(0.2, 0.3), (4.0, 5.0)]) == [1000.0]  # one that ended as a span began: not it
    assert demotion.touched(gaps, []) == []


def test_copies_are_read_from_the_decode_log() -> None:
    text = ("INFO 12-04 14:20:01 [worker.py:460] kvshuttle: host tier: demoted 0123456789ab (65.0 MiB) in 21.5 ms "
            "(3.17 GB/s)\nINFO kvshuttle: request x read 263 tokens\n"
            "kvshuttle: host tier: demoted ba9876543210 (130.0 MiB) in 40.0 ms (3.41 GB/s)\n")
    assert demotion.copies(text) == {"0123456789ab": (65.0, 21.5), "ba9876543210": (130.0, 40.0)}


def test_copies_past_their_window_are_counted() -> None:
    windows = [("demote", 0.0, 2.0), ("quiet", 2.0, 4.0)]
    assert demotion.past_windows([(0.1, 0.5), (1.5, 2.5), (5.0, 6.0)], windows) == 1


def _gaps(start: float, ms: list[float]) -> list[tuple[float, float]]:
    out, t = [], start
    for x in ms:
        out.append((t, t + x / 1e3))
        t += x / 1e3
    return out


def test_compare_gives_the_ratios_of_demote_over_quiet_windows() -> None:
    quiet = _gaps(0.0, [20.0] * 99 + [40.0])  # p99 40
    demote = _gaps(10.0, [20.0] * 98 + [60.0, 80.0])  # p99 80: one copy lengthened two gaps
    windows = [("quiet", 0.0, 5.0), ("demote", 10.0, 15.0)]
    spans = [(demote[-2][0] + 0.001, demote[-2][0] + 0.002)]  # the copy met the 60 ms gap only
    out = demotion.compare(quiet + demote, windows, spans, [(0.0, 0.001)])
    assert out["quiet"]["tokens"] == out["demote"]["tokens"] == 100
    assert out["quiet"]["itl_ms_p99"] == 40.0 and out["demote"]["itl_ms_p99"] == 80.0
    assert out["p99_demote_over_quiet"] == 2.0 and out["p50_demote_over_quiet"] == 1.0
    assert out["touched"]["demote"]["itl_ms_max"] == 60.0 and out["touched"]["quiet"]["itl_ms_max"] == 20.0
    assert out["touched_p50_over_quiet"] == 3.0
    empty = demotion.compare([], windows, [], [])
    assert empty["p99_demote_over_quiet"] is None and empty["demote"] == {"tokens": 0}


def test_summary_percentiles() -> None:
    s = summary([float(x) for x in range(1, 201)])
    assert (s["tokens"], s["itl_ms_p50"], s["itl_ms_p90"], s["itl_ms_p99"], s["itl_ms_max"]) == (200, 100.5, 181.0,
                                                                                                 199.0, 200.0)
    assert summary([]) == {"tokens": 0}


def test_table_prints_each_kind_and_round() -> None:
    row: dict[str, Any] = demotion.compare(_gaps(0.0, [20.0] * 10), [("quiet", 0.0, 1.0)], [], [])
    row.update({"round_spread": {"p99_demote_over_quiet": None}, "demoted": 4, "demotions": 4,
                "copy_mib_median": 65.0, "copy_ms_median": 20.0, "copy_gbps_median": 3.4, "offered_mib_per_s": 32.5,
                "per_round": [{"round": 1, "quiet_p99_ms": 20.0, "demote_p99_ms": None, "p99_demote_over_quiet": None,
                               "load_avg": [1.0, 1.0, 1.0]}]})
    text = demotion.format_table({"results": [row], "machine": {"load_avg": [1.0, 1.0, 1.0]}})
    assert "quiet windows" in text and "4/4 demoted" in text and "round 1" in text
