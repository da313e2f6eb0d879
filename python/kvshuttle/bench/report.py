"""Render the current benchmark tables (ratios, each row naming its JSON) and plots from benchmarks/results.

``kvshuttle bench report`` prints every table as markdown; ``--check benchmarks/README.md`` fails when the README's
generated blocks (between ``<!-- report:NAME -->`` and ``<!-- /report -->``) differ from what the JSON renders;
``--write`` rewrites them; ``--plots DIR`` draws one PNG per table (matplotlib, the ``plan`` extra).

Which files are current is listed here (``TABLES``), not guessed from names: a rerun that should replace a row is
committed under the same name, and the file it replaces moves to ``results/history/`` (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KVShuttleError


class ReportError(KVShuttleError, ValueError):
    """A benchmark JSON the report needs is missing or lacks a field; or a README's generated tables are stale."""


# A ratio as the benches record it: the median of per-round ratios and, where rounds were kept, their min-max.
@dataclass(frozen=True)
class Ratio:
    median: float
    low: float | None = None
    high: float | None = None

    def __str__(self) -> str:
        if self.low is None or self.high is None:
            return f"{self.median:.2f}"
        return f"{self.median:.2f} ({self.low:.2f}-{self.high:.2f})"


@dataclass(frozen=True)
class Row:
    label: str  # the row in a plot
    cells: tuple[str, ...]
    ratios: dict[str, Ratio]  # plotted: header name -> ratio
    source: str  # the JSON file the row's numbers come from


@dataclass
class Table:
    name: str
    title: str
    header: tuple[str, ...]
    rows: list[Row] = field(default_factory=list)

    def markdown(self) -> str:
        lines = ["| " + " | ".join((*self.header, "JSON")) + " |", "|" + "---|" * (len(self.header) + 1)]
        lines += ["| " + " | ".join((*row.cells, f"`{row.source}`")) + " |" for row in self.rows]
        return "\n".join(lines)


class Results:
    """The JSON files of one results directory, loaded once each; every lookup names the file on failure."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._docs: dict[str, dict[str, Any]] = {}

    def doc(self, name: str) -> dict[str, Any]:
        if name not in self._docs:
            path = self.directory / name
            try:
                loaded = json.loads(path.read_text())
            except FileNotFoundError:
                raise ReportError(f"{path}: missing (rerun its bench, or take it out of report.TABLES)") from None
            except json.JSONDecodeError as exc:
                raise ReportError(f"{path}: not JSON ({exc})") from None
            if not isinstance(loaded, dict):
                raise ReportError(f"{path}: not a JSON object")
            self._docs[name] = loaded
        return self._docs[name]

    def rows(self, name: str) -> list[dict[str, Any]]:
        rows = get(self.doc(name), "results", name)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ReportError(f"{name}: 'results' is not a list of objects")
        return rows


def get(obj: Any, key: str, where: str) -> Any:
    """``obj[key]``, or a ReportError naming the file and row that lack it."""
    if not isinstance(obj, dict) or key not in obj:
        raise ReportError(f"{where}: no field {key!r}")
    return obj[key]


def number(obj: Any, key: str, where: str) -> float:
    value = get(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{where}: field {key!r} is {value!r}, not a number")
    return float(value)


def ratio(row: dict[str, Any], key: str, where: str) -> Ratio:
    """A bench's ``<subject>_vs_<peer>`` with its per-round min-max (``ratio_spread``; null for converted runs)."""
    spread = row.get("ratio_spread", {}).get(key)
    if spread is None:
        return Ratio(number(row, key, where))
    return Ratio(number(row, key, where), number(spread, "min", f"{where} ratio_spread"),
                 number(spread, "max", f"{where} ratio_spread"))


def time_ratio(peer: dict[str, Any], subject: dict[str, Any], key: str, where: str) -> Ratio:
    """peer seconds / subject seconds: > 1 means the subject is faster (the benches' ``_vs_`` convention)."""
    subject_s = number(get(subject, "seconds", where), key, f"{where} seconds")
    if subject_s <= 0:
        raise ReportError(f"{where}: seconds[{key!r}] is {subject_s}, not positive")
    return Ratio(number(get(peer, "seconds", where), key, f"{where} seconds") / subject_s)


def _wide(results: Results, table: Table, files: Iterable[str], labels: Callable[[dict[str, Any]], tuple[str, ...]],
          keys: tuple[str, ...]) -> Table:
    """One row per result: its label cells, then each ratio in ``keys`` (the header's last columns)."""
    for name in files:
        for i, row in enumerate(results.rows(name)):
            where = f"{name}: results[{i}]"
            cells = labels(row)
            ratios = {h: ratio(row, k, where) for h, k in zip(table.header[len(cells):], keys, strict=True)}
            table.rows.append(Row(" ".join(cells), (*cells, *map(str, ratios.values())), ratios, name))
    return table


def pack(results: Results) -> Table:
    table = Table("pack", "Pack / unpack", ("shape", "device", "pack / memcpy", "unpack / memcpy",
                                            "pack / peer", "unpack / peer"))
    return _wide(results, table, ("vm5_pack_cpu.json", "h200_pack_cuda.json"),
                 lambda r: (str(get(r, "shape", "pack row")), str(get(r, "device", "pack row"))),
                 ("pack_vs_copy", "unpack_vs_copy", "pack_vs_peer", "unpack_vs_peer"))


def transfer(results: Results) -> Table:
    table = Table("transfer", "NIXL reads between two processes",
                  ("shape", "pattern", "MiB", "packed / memcpy", "packed / direct", "direct / raw per block",
                   "auto / best"))

    def labels(r: dict[str, Any]) -> tuple[str, ...]:
        mib = number(r, "bytes", "transfer row") / 2**20
        return str(get(r, "shape", "transfer row")), str(get(r, "pattern", "transfer row")), f"{mib:g}"

    return _wide(results, table, ("vm5_transfer.json", "vm5_transfer_1536.json", "vm5_transfer_sweep.json"), labels,
                 ("packed_vs_memcpy", "packed_vs_direct", "direct_vs_raw_per_block", "auto_vs_best"))


def plan(results: Results) -> Table:
    table = Table("plan", "Read planning", ("case", "descriptors", "native / peer", "native / reference"))

    def labels(r: dict[str, Any]) -> tuple[str, ...]:
        descriptors = int(number(get(r, "descriptors", "plan row"), "native", "plan row descriptors"))
        return str(get(r, "case", "plan row")), f"{descriptors:,}"

    return _wide(results, table, ("vm2_plan.json",), labels, ("native_vs_peer", "native_vs_reference"))


def _long(table: Table, name: str, where: str, label: str, ratios: dict[str, Ratio]) -> None:
    """One row per ratio: (label, what against what, the ratio)."""
    for against, value in ratios.items():
        table.rows.append(Row(f"{label} {against}", (label, against, str(value)), {against: value}, name))


def policy(results: Results) -> Table:
    table = Table("policy", "Policy and digests", ("case", "ratio", "value"))
    name = "vm2_policy.json"
    for i, row in enumerate(results.rows(name)):
        where = f"{name}: results[{i}]"
        keys = sorted(k for k in row if "_vs_" in k)
        _long(table, name, where, str(get(row, "case", where)),
              {k.replace("_vs_", " / "): ratio(row, k, where) for k in keys})
    return table


def packed(results: Results) -> Table:
    """The packed path's copies with no protocol (memcpy bound) and its CPU cost (against direct)."""
    table = Table("packed", "Packed reads: the bound and the CPU budget", ("method", "ratio", "value"))
    for name, peer in (("vm5_packed_bound.json", "memcpy"), ("vm5_packed_cpu_budget.json", "direct")):
        methods = get(results.doc(name), "methods", name)
        for method, values in methods.items():
            if method == peer:
                continue
            where = f"{name}: methods[{method!r}]"
            value = number(values, f"vs_{peer}", where)
            span = values.get(f"vs_{peer}_range")
            low, high = (float(span[0]), float(span[1])) if span else (None, None)
            _long(table, name, where, method, {f"speed / {peer}": Ratio(value, low, high)})
    return table


def retention(results: Results) -> Table:
    table = Table("retention", "Retention ledger", ("operation", "us at 10k", "us at 1M", "growth 10k -> 1M"))
    name = "vm2_retention.json"
    rows = sorted(results.rows(name), key=lambda r: number(r, "live_handles", name))
    if len(rows) < 2:
        raise ReportError(f"{name}: growth needs at least two ledger sizes, found {len(rows)}")
    first, last = rows[0], rows[-1]
    for op in ("retain", "claim_complete", "renew", "sweep_idle", "sweep_due_per_handle", "retain_evict"):
        growth = time_ratio(last, first, op, name)  # time at 1M / time at 10k: 1.5 is O(log n), 100 is O(n)
        small = number(get(first, "seconds", name), op, name) * 1e6
        large = number(get(last, "seconds", name), op, name) * 1e6
        table.rows.append(Row(op, (op, f"{small:.2f}", f"{large:.2f}", str(growth)), {"growth": growth}, name))
    return table


# (file, subject config, peer config, cases): every (case, length) at turn 2, the first turn that reuses KV.
E2E_PAIRS = (
    ("vm2_e2e.json", "kvshuttle", "nixl", ("main", "edited")),
    ("vm2_e2e.json", "kvshuttle", "recompute", ("main",)),
    ("vm2_e2e_kvheavy.json", "kvshuttle", "nixl", ("main",)),
    ("vm2_e2e_tp.json", "kvshuttle_tp", "kvshuttle", ("main",)),
    ("vm2_e2e_layered.json", "kvshuttle_layered", "kvshuttle", ("main",)),
    ("vm2_e2e_layered.json", "kvshuttle_layered", "floor", ("main",)),
    ("vm2_e2e_layered_kvheavy.json", "kvshuttle_layered", "kvshuttle", ("main",)),
    ("vm2_e2e_layered_kvheavy.json", "kvshuttle_layered", "floor", ("main",)),
    ("vm5_e2e_mla.json", "kvshuttle", "nixl", ("main", "edited")),  # the tiny DeepSeek-V2 (CPU_MLA), --mla
    ("vm5_e2e_mla.json", "kvshuttle", "recompute", ("main",)),
)


def e2e(results: Results) -> Table:
    table = Table("e2e", "End to end in vLLM", ("case", "tokens", "subject / peer", "reused", "match",
                                                "TTFT peer / subject", "turn peer / subject"))
    for name, subject, peer, cases in E2E_PAIRS:
        by_key: dict[tuple[str, str, int, int], dict[str, Any]] = {}
        for i, row in enumerate(results.rows(name)):
            where = f"{name}: results[{i}]"
            key = (str(get(row, "config", where)), str(get(row, "case", where)),
                   int(number(row, "first_tokens", where)), int(number(row, "turn", where)))
            by_key[key] = row
        pairs = [(k, by_key.get((peer, *k[1:]))) for k in by_key if k[0] == subject and k[1] in cases and k[3] == 2]
        if not pairs:
            raise ReportError(f"{name}: no turn-2 rows of config {subject!r} in cases {cases}")
        for (_, case, tokens, turn), peer_row in pairs:
            where = f"{name}: {case} {tokens} turn {turn}"
            if peer_row is None:
                raise ReportError(f"{where}: no row of config {peer!r} to compare {subject!r} with")
            subject_row = by_key[(subject, case, tokens, turn)]
            ttft = time_ratio(peer_row, subject_row, "prefill_ttft", where)
            turn_ratio = time_ratio(peer_row, subject_row, "turn", where)
            reused = f"{subject_row.get('reused_tokens')} / {peer_row.get('reused_tokens')}"
            match = f"{subject_row.get('matches_local_count')} / {peer_row.get('matches_local_count')}"
            cells = (case, str(tokens), f"{subject} / {peer}", reused, match, str(ttft), str(turn_ratio))
            table.rows.append(Row(f"{case} {tokens} {subject}/{peer}", cells, {"TTFT": ttft, "turn": turn_ratio},
                                  name))
    return table


def placement(results: Results) -> Table:
    table = Table("placement", "Placement against the production baseline",
                  ("config", "later turns' TTFT / floor", "turn / floor"))
    for name in ("vm2_placement.json", "vm2_placement_bystander.json"):
        rows = results.rows(name)
        floors = [r for r in rows if r.get("config") == "floor"]
        if not floors:
            raise ReportError(f"{name}: no 'floor' row to divide by")
        for i, row in enumerate(rows):
            where = f"{name}: results[{i}]"
            config = str(get(row, "config", where))
            # time over the floor's (the lower bound, same run): 1.0 is the floor, > 1 slower
            ttft = Ratio(number(row, "ttft_over_floor", where))
            turn = time_ratio(row, floors[0], "turn_median", where)
            table.rows.append(Row(config, (config, str(ttft), str(turn)), {"TTFT": ttft, "turn": turn}, name))
    return table


def router(results: Results) -> Table:
    table = Table("router", "Multi-turn router under load",
                  ("case", "req/s offered", "req/s served", "direct / router time", "p99 added ms",
                   "router CPU ms/turn", "lost handles"))
    for name in ("vm2_router_100.json", "vm2_router_cpu.json"):
        offered = number(get(results.doc(name), "config", name), "rate", f"{name} config")
        for i, row in enumerate(results.rows(name)):
            where = f"{name}: results[{i}]"
            seconds = get(row, "seconds", where)
            # the same request straight to the backends over through the router, interleaved: < 1 is the router's cost
            speed = Ratio(number(seconds, "direct", where) / max(number(seconds, "router", where), 1e-12))
            added = number(get(get(row, "latency", where), "total_p99_ms", where), "added", where)
            cpu = number(get(row, "cpu_ms_per_request", where), "routers", where)
            lost = int(number(get(row, "handles", where), "lost", where))
            case = str(get(row, "case", where))
            cells = (case, f"{offered:g}", f"{number(row, 'rate_achieved', where):g}", str(speed), f"{added:.1f}",
                     f"{cpu:.2f}", str(lost))
            table.rows.append(Row(f"{case} @{offered:g}", cells, {"direct / router": speed}, name))
    return table


def index(results: Results) -> Table:
    """The content index's lookup against the same run's Redis floor: MGET of as many keys / lookup (< 1: the lookup
    costs more than the bare round trip), p50 and p99, per stride and case."""
    table = Table("index", "Content index lookups", ("stride", "retentions", "case", "keys asked",
                                                     "lookup p50 / p99 ms", "MGET / lookup (p50)",
                                                     "MGET / lookup (p99)"))
    for name in ("vm5_index.json", "vm5_index_repeat.json", "vm5_index_strides.json"):
        for i, row in enumerate(results.rows(name)):
            where = f"{name}: results[{i}]"
            if get(row, "case", where) == "publish":
                continue
            seconds = get(row, "seconds", where)
            p50, p99 = (number(seconds, f"lookup_{q}", where) * 1e3 for q in ("p50", "p99"))
            mget = ratio(row, "lookup_vs_mget", where)
            tail = Ratio(number(row, "p99_mget_over_lookup", where))
            cells = (f"{int(number(row, 'stride', where))}", f"{int(number(row, 'retentions', where)):,}",
                     str(row["case"]), f"{int(number(row, 'keys_asked', where))}", f"{p50:.2f} / {p99:.2f}",
                     str(mget), str(tail))
            table.rows.append(Row(f"s{int(number(row, 'stride', where))} {row['case']}", cells,
                                  {"MGET / lookup": mget}, name))
    return table


def clients(results: Results) -> Table:
    """aiperf through the router, per way the client names its session (and per tier a paused history is read
    back from): later turns that read their history back, against the body-key row, and later turns' TTFT against
    the recompute row of the same run."""
    table = Table("clients", "Real clients through the router", ("session key", "later turns", "reused",
                                                                  "tokens read", "reused / body",
                                                                  "recompute / later TTFT", "answers = recompute"))
    for name in CLIENT_RUNS:
        rows = {str(get(row, "row", f"{name}: results[{i}]")): row for i, row in enumerate(results.rows(name))}
        for key in ("body", "recompute"):
            if key not in rows:
                raise ReportError(f"{name}: no {key!r} row to compare with")
        base = number(rows["body"], "reused_turns", f"{name}: body")
        floor = number(get(rows["recompute"], "seconds", f"{name}: recompute"), "ttft_median", f"{name}: recompute")
        for label, row in rows.items():
            where = f"{name}: {label}"
            reused = number(row, "reused_turns", where)
            speed = Ratio(floor / number(get(row, "seconds", where), "ttft_median", where))
            share = Ratio(reused / base) if base else Ratio(0.0)
            cells = (label, f"{int(number(row, 'later_turns', where))}", f"{int(reused)}",
                     f"{int(number(row, 'read_tokens', where)):,}", str(share), str(speed),
                     f"{int(number(row, 'answers_equal', where))}/{int(number(row, 'answers_checked', where))}")
            table.rows.append(Row(f"{label} {name.removesuffix('.json')}", cells,
                                  {"reused / body": share, "recompute / later TTFT": speed}, name))
    return table


def gpu_tier(results: Results) -> Table:
    """The host tier on a GPU (``bench transfer --device cuda --host-tier``): its direct and packed reads against
    the hot cache's, its demotion against one device-to-host copy of the same bytes."""
    table = Table("gpu_tier", "Host tier on a GPU", ("shape", "MiB", "tier direct / hot direct",
                                                     "tier packed / hot direct", "tier packed / hot packed",
                                                     "demotion / D2H copy"))
    name = "h200_tier_cuda.json"
    rows = [r for r in results.rows(name) if r.get("host_tier")]
    if not rows:
        raise ReportError(f"{name}: no host tier rows")
    for i, row in enumerate(rows):
        where = f"{name}: host tier row {i}"
        cells = (str(get(row, "shape", where)), f"{number(row, 'bytes', where) / 2**20:g}")
        keys = ("tier_direct_vs_hot_direct", "tier_vs_hot_direct", "tier_vs_hot_packed", "demotion_vs_d2h")
        ratios = {h: ratio(row, k, where) for h, k in zip(table.header[2:], keys, strict=True)}
        table.rows.append(Row(" ".join(cells), (*cells, *map(str, ratios.values())), ratios, name))
    return table


def tier_reads(results: Results) -> Table:
    """``bench transfer --host-tier`` on this VM: the same blocks read from a demoted retention and from a hot one,
    each path against the same path (claimed reads, interleaved)."""
    table = Table("tier_reads", "Host tier reads against hot reads", (
        "shape", "MiB", "tier direct / hot direct", "tier packed / hot packed", "tier direct / hot packed"))
    for name in ("vm6_transfer_tier.json", "vm6_transfer_tier_repeat.json"):
        for i, row in enumerate(results.rows(name)):
            where = f"{name}: results[{i}]"
            tier = get(row, "host_tier", where)
            cells = (str(get(row, "shape", where)), f"{number(row, 'bytes', where) / 2**20:g}")
            keys = ("tier_direct_vs_hot_direct", "tier_vs_hot", "tier_direct_vs_hot_packed")
            ratios = {h: ratio(tier, k, where) for h, k in zip(table.header[2:], keys, strict=True)}
            table.rows.append(Row(" ".join(cells), (*cells, *map(str, ratios.values())), ratios, name))
    return table


def tier_replay(results: Results) -> Table:
    """The shortened live Claude Code replay: each run's hit rate and the decode's hot peak, measured and as the
    planner predicts it on the same turns; the hot peak over the same file's single-tier run's."""
    table = Table("tier_replay", "Live replay against the planner's tiers", (
        "run", "hot TTL s", "later turns", "hit rate (plan)", "host-tier reads", "hot peak blocks (plan)",
        "hot peak / single (plan)"))
    for name in ("vm6_tier_replay.json", "vm6_tier_replay_repeat.json", "vm6_tier_replay_ttl025.json"):
        rows = {str(get(row, "row", f"{name}: results[{i}]")): row for i, row in enumerate(results.rows(name))}
        if "single" not in rows:
            raise ReportError(f"{name}: no 'single' row to compare with")
        base = number(rows["single"], "hot_peak_blocks", f"{name}: single")
        plan_base = number(get(rows["single"], "predicted", f"{name}: single"), "hot_peak_blocks", f"{name}: single")
        for label, row in rows.items():
            where = f"{name}: {label}"
            plan = get(row, "predicted", where)
            peak, plan_peak = number(row, "hot_peak_blocks", where), number(plan, "hot_peak_blocks", where)
            share = Ratio(peak / base) if base else Ratio(0.0)
            plan_share = Ratio(plan_peak / plan_base) if plan_base else Ratio(0.0)
            cells = (label, f"{number(row, 'hot_ttl_s', where):g}", f"{int(number(row, 'later_turns', where))}",
                     f"{number(row, 'hit_rate', where):.2f} ({number(plan, 'hit_rate', where):.2f})",
                     f"{int(number(get(row, 'tier', where), 'reads', where))}", f"{peak:.0f} ({plan_peak:.0f})",
                     f"{share} ({plan_share})")
            table.rows.append(Row(f"{label} {name.removesuffix('.json')}", cells, {"hot peak / single": share}, name))
    return table


def demotion(results: Results) -> Table:
    """The decode's bystanders while its retentions are demoted into the host tier, against quiet windows of the
    same run: their inter-token gaps (p50, p99) and the ratio (> 1: demotion slowed them), per-round min-max."""
    table = Table("demotion", "What demotion costs the decode's other requests",
                  ("run", "demotions", "MiB each, copy ms (GB/s)", "ITL p50 quiet / demote ms",
                   "p99 quiet / demote ms", "p99 demote / quiet", "met a copy: p50 / quiet", "load (1 min, per round)"))
    for name in ("vm6_demotion.json", "vm6_demotion_repeat.json", "vm6_demotion_aa.json"):  # aa: nothing demoted
        for i, row in enumerate(results.rows(name)):
            where = f"{name}: results[{i}]"
            loads = [float(get(r, "load_avg", where)[0]) for r in get(row, "per_round", where)]
            quiet, demote = get(row, "quiet", where), get(row, "demote", where)
            spread = get(row, "round_spread", where).get("p99_demote_over_quiet") or {}
            p99 = Ratio(number(row, "p99_demote_over_quiet", where), spread.get("min"), spread.get("max"))
            met = Ratio(number(row, "touched_p50_over_quiet", where)) if row.get("demotions") else None
            copy = "-" if not row.get("demotions") else (
                f"{number(row, 'copy_mib_median', where):.0f}, {number(row, 'copy_ms_median', where):.1f} "
                f"({number(row, 'copy_gbps_median', where):.2f})")
            cells = (name.removesuffix(".json").removeprefix("vm6_"),
                     f"{int(number(row, 'demoted', where))}/{int(number(row, 'demotions', where))}", copy,
                     f"{number(quiet, 'itl_ms_p50', where):.1f} / {number(demote, 'itl_ms_p50', where):.1f}",
                     f"{number(quiet, 'itl_ms_p99', where):.1f} / {number(demote, 'itl_ms_p99', where):.1f}",
                     str(p99), str(met or "-"), f"{min(loads):g}-{max(loads):g}")
            plotted = {"p99 demote / quiet": p99, **({"met a copy / quiet": met} if met else {})}
            table.rows.append(Row(name.removesuffix(".json"), cells, plotted, name))
    return table


CLIENT_RUNS = ("vm5_clients.json", "vm6_clients_tiers.json")  # each with its own body and recompute rows


TABLES: dict[str, Callable[[Results], Table]] = {
    "pack": pack, "transfer": transfer, "packed": packed, "plan": plan, "policy": policy, "retention": retention,
    "e2e": e2e, "placement": placement, "router": router, "index": index, "clients": clients, "demotion": demotion,
    "tier_reads": tier_reads, "tier_replay": tier_replay, "gpu_tier": gpu_tier,
}
# A block's body never holds a marker; an empty body (a new block) is "<!-- report:x -->\n<!-- /report -->".
BLOCK = re.compile(r"<!-- report:(?P<name>[a-z0-9_]+) -->\n(?P<body>(?:(?!<!-- /?report).)*?)\n?<!-- /report -->", re.S)


def render(directory: Path, names: Iterable[str] | None = None) -> dict[str, Table]:
    results = Results(directory)
    return {name: TABLES[name](results) for name in (names or TABLES)}


def current_files(tables: dict[str, Table]) -> set[str]:
    return {row.source for table in tables.values() for row in table.rows}


def stale_blocks(readme: str, tables: dict[str, Table]) -> list[str]:
    """What differs between a README's generated blocks and ``tables``: one line per table, empty when none."""
    found = {m["name"]: m["body"] for m in BLOCK.finditer(readme)}
    problems = [f"{name}: no <!-- report:{name} --> block" for name in tables if name not in found]
    problems += [f"{name}: block names no table (known: {', '.join(TABLES)})" for name in found if name not in TABLES]
    problems += [f"{name}: differs from the JSON (kvshuttle bench report --write README)"
                 for name, body in found.items() if name in tables and body != tables[name].markdown()]
    return problems


def rewrite(readme: str, tables: dict[str, Table]) -> str:
    """The README with every generated block replaced by its table."""
    def block(m: re.Match[str]) -> str:
        body = tables[m["name"]].markdown() if m["name"] in tables else m["body"]
        return f"<!-- report:{m['name']} -->\n{body}\n<!-- /report -->"

    return BLOCK.sub(block, readme)


def plot(tables: dict[str, Table], directory: Path) -> list[Path]:
    """One PNG per table: a panel per plotted ratio, a bar per row with its min-max, a line at 1.0."""
    import matplotlib  # optional (the plan extra): imported only when plots are asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables.values():
        panels = list(dict.fromkeys(k for row in table.rows for k in row.ratios))
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels) + 2, 0.3 * len(table.rows) + 1.5),
                                 squeeze=False, sharey=True)
        labels = [f"{row.label} [{row.source.removesuffix('.json')}]" for row in table.rows]
        for ax, panel in zip(axes[0], panels, strict=True):
            values = [row.ratios.get(panel) for row in table.rows]
            medians = [v.median if v else 0.0 for v in values]
            errors = [[v.median - v.low if v and v.low is not None else 0.0 for v in values],
                      [v.high - v.median if v and v.high is not None else 0.0 for v in values]]
            ax.barh(range(len(values)), medians, xerr=errors, color="tab:blue", ecolor="grey")
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_title(panel, fontsize=9)
        axes[0][0].set_yticks(range(len(labels)), labels, fontsize=7)
        axes[0][0].invert_yaxis()
        fig.suptitle(table.title)
        fig.tight_layout()
        path = directory / f"{table.name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _default_results() -> Path:
    """benchmarks/results of this checkout, else of the current directory."""
    for base in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (base / "benchmarks" / "results").is_dir():
            return base / "benchmarks" / "results"
    return Path("benchmarks/results")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=None, help="directory of the JSON (default: the checkout's)")
    parser.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated subset of {','.join(TABLES)}")
    parser.add_argument("--check", type=Path, metavar="README", help="fail if README's generated tables are stale")
    parser.add_argument("--write", type=Path, metavar="README", help="rewrite README's generated tables")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="also write one PNG per table there (matplotlib)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n for n in args.tables.split(",") if n]
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise ReportError(f"unknown tables {unknown}: pick from {', '.join(TABLES)}")
    tables = render(args.results or _default_results(), names)
    out: dict[str, Any] = {"bench": "report", "tables": tables, "plots": [], "stale": []}
    if args.write:
        args.write.write_text(rewrite(args.write.read_text(), tables))
    if args.check:
        out["stale"] = stale_blocks(args.check.read_text(), tables)
        if out["stale"]:
            raise SystemExit(f"{args.check}: generated tables out of date:\n  " + "\n  ".join(out["stale"]))
    if args.plots:
        out["plots"] = [str(p) for p in plot(tables, args.plots)]
    if getattr(args, "json", False):  # the CLI prints it: plain JSON, rows with their sources
        out["tables"] = {n: {"header": [*t.header, "JSON"], "rows": [[*r.cells, r.source] for r in t.rows]}
                         for n, t in tables.items()}
    return out


def format_table(result: dict[str, Any]) -> str:
    tables: dict[str, Table] = result["tables"]
    text = "\n\n".join(f"### {t.title}\n\n{t.markdown()}" for t in tables.values())
    return text + "".join(f"\nplot: {p}" for p in result["plots"])
