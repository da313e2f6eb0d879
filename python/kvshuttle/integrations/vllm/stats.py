"""What the connector reports through vLLM's own stats path: decisions by reason, reads and their cost,
retention. Both sides report; vLLM merges them with ``aggregate`` and logs ``reduce()`` as
"KV Transfer metrics: ..." (and hands the same data to :class:`ShuttlePromMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...reuse import ReuseResult
from .compat import KVConnectorPromMetrics, KVConnectorStats

GAUGES = ("retained_blocks", "retained_bytes", "live_handles")  # the latest value wins, not the sum
# A retention tier's numbers (``tier.<name>.<what>``, the worker's ledger's ``metrics()["tiers"]``): these are
# gauges, the others (demotions, reads, misses, ...) counters of what happened since the last stats
TIER_GAUGES = ("blocks", "bytes", "capacity_blocks", "live_handles")
TIER_COUNTERS = ("demotions", "reads", "misses")  # exported as Prometheus counters (the rest: log line only)


def is_gauge(key: str) -> bool:
    """Whether ``key`` is a gauge (the latest report wins) rather than a counter (reports add up)."""
    return key in GAUGES or (key.startswith("tier.") and key.rpartition(".")[2] in TIER_GAUGES)


def tier_values(data: dict[str, Any], what: str) -> dict[str, Any]:
    """``{tier name: value}`` of ``tier.<name>.<what>`` in ``data``."""
    return {key[5:-len(what) - 1]: value for key, value in data.items()
            if key.startswith("tier.") and key.endswith("." + what) and key.count(".") == 2}


@dataclass
class ShuttleStats(KVConnectorStats):
    """``data``: counters (``decision.<reason>``, ``read.<outcome>``, ``tokens_read``, ``bytes_read``,
    ``transfer_s``, ...) and the gauges in :data:`GAUGES`. Plain numbers: picklable and msgpack-able."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = value if is_gauge(key) else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}
        reads = self.data.get("read.fetched", 0)
        if reads:
            out["avg_transfer_ms"] = round(1e3 * self.data.get("transfer_s", 0.0) / reads, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data

    @staticmethod
    def counting(counts: dict[str, int], prefix: str) -> ShuttleStats:
        return ShuttleStats(data={f"{prefix}.{k}": v for k, v in counts.items()})

    def add_result(self, result: ReuseResult) -> None:
        outcome = "fetched" if result.action == "fetched" else result.reason
        self.data[f"read.{outcome}"] = self.data.get(f"read.{outcome}", 0) + 1
        if result.owner_reason:
            key = f"refused.{result.owner_reason}"
            self.data[key] = self.data.get(key, 0) + 1
        if result.telemetry is not None:
            self.data["tokens_read"] = self.data.get("tokens_read", 0) + result.fetched_tokens
            self.data["bytes_read"] = self.data.get("bytes_read", 0) + result.bytes
            self.data["transfer_s"] = self.data.get("transfer_s", 0.0) + result.telemetry.transfer_time_s


class ShuttlePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvshuttle_*`` Prometheus metrics, one series per engine (vLLM's ``model_name``/``engine`` labels)."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, gauge = self._counter_cls, self._gauge_cls
        self._events = counter(name="vllm:kvshuttle_events", documentation="kvshuttle decisions, reads, "
                               "refusals and hook errors, by kind (e.g. decision.fetch, read.claim_refused)",
                               labelnames=[*labelnames, "kind"])
        self._tokens = counter(name="vllm:kvshuttle_tokens_read", documentation="Tokens whose KV was read from a "
                               "peer instead of computed", labelnames=labelnames)
        self._bytes = counter(name="vllm:kvshuttle_bytes_read", documentation="KV bytes read from peers",
                              labelnames=labelnames)
        self._retained = gauge(name="vllm:kvshuttle_retained_blocks", documentation="Blocks kept for readers",
                               labelnames=labelnames, multiprocess_mode="mostrecent")
        tiered = [*labelnames, "tier"]
        self._tier_gauges = {
            "blocks": gauge(name="vllm:kvshuttle_tier_blocks", documentation="Blocks a retention tier (host "
                            "memory, disk files) holds for readers", labelnames=tiered, multiprocess_mode="mostrecent"),
            "bytes": gauge(name="vllm:kvshuttle_tier_bytes", documentation="Bytes a retention tier holds",
                           labelnames=tiered, multiprocess_mode="mostrecent")}
        self._tier_counters = {
            "demotions": counter(name="vllm:kvshuttle_tier_demotions", documentation="Retentions moved into a tier "
                                 "instead of ending (a TTL or an eviction of the tier before)", labelnames=tiered),
            "reads": counter(name="vllm:kvshuttle_tier_reads", documentation="Reads served from a tier",
                             labelnames=tiered),
            "misses": counter(name="vllm:kvshuttle_tier_misses", documentation="Claims refused for a tier reason "
                              "(evicted from it, expired in it, no room to demote, a disk file lost)",
                              labelnames=tiered)}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if key.startswith(("decision.", "read.", "refused.", "hook_error.")):
                self._events.labels(*labels, key).inc(value)
        self._tokens.labels(*labels).inc(transfer_stats_data.get("tokens_read", 0))
        self._bytes.labels(*labels).inc(transfer_stats_data.get("bytes_read", 0))
        if "retained_blocks" in transfer_stats_data:
            self._retained.labels(*labels).set(transfer_stats_data["retained_blocks"])
        for what, metric in self._tier_gauges.items():
            for tier, value in tier_values(transfer_stats_data, what).items():
                metric.labels(*labels, tier).set(value)
        for what, counted in self._tier_counters.items():
            for tier, value in tier_values(transfer_stats_data, what).items():
                counted.labels(*labels, tier).inc(value)
