"""pytest-benchmark cases for the retention ledger at 10k live handles (one block each).

Run: pytest benchmarks/bench_retention.py --benchmark-enable --benchmark-group-by=func
`kvshuttle bench retention` runs 10k, 100k and 1M live handles and prints the growth ratios.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvshuttle.retention import RetentionLedger

LIVE, DUE = 10_000, 100
DIGESTS = [b"0123456789abcdef"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def filled() -> tuple[RetentionLedger, Clock, list[str]]:
    clock = Clock()
    ledger = RetentionLedger("bench", "127.0.0.1", 5600, ttl_s=1e9, clock=clock, wall_clock=clock)
    ids = [ledger.retain("r", [i], DIGESTS, 16, 16).handle_id for i in range(LIVE)]
    return ledger, clock, ids


def test_retain_release(benchmark: Any, filled: tuple[RetentionLedger, Clock, list[str]]) -> None:
    ledger, _, _ = filled
    blocks = itertools.count(LIVE)

    def cycle() -> None:
        ledger.release(ledger.retain("r", [next(blocks)], DIGESTS, 16, 16).handle_id)

    benchmark(cycle)
    assert len(ledger) == LIVE


def test_claim_complete(benchmark: Any, filled: tuple[RetentionLedger, Clock, list[str]]) -> None:
    ledger, _, ids = filled
    picks = itertools.cycle(ids[:: 97])
    benchmark(lambda: ledger.complete(ledger.claim(next(picks), 0).claim_id))
    assert ledger.metrics()["hits"] > 0


def test_renew(benchmark: Any, filled: tuple[RetentionLedger, Clock, list[str]]) -> None:
    ledger, clock, ids = filled
    picks = itertools.cycle(ids[:: 97])
    clock.now = 100.0
    renewed = benchmark(lambda: ledger.renew(next(picks)))
    assert renewed.handle_id in ids and renewed.expiry_time >= 100.0 + 1e9 and len(ledger) == LIVE


def test_sweep_nothing_due(benchmark: Any, filled: tuple[RetentionLedger, Clock, list[str]]) -> None:
    ledger, _, _ = filled
    assert benchmark(ledger.sweep) == 0


def test_sweep_k_due(benchmark: Any, filled: tuple[RetentionLedger, Clock, list[str]]) -> None:
    ledger, clock, _ = filled
    blocks = itertools.count(LIVE)

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        for _ in range(DUE):
            ledger.retain("r", [next(blocks)], DIGESTS, 16, 16, ttl_s=1.0)
        return (clock.now + 1.0,), {}

    expired = benchmark.pedantic(ledger.sweep, setup=setup, rounds=50)
    assert expired == DUE and len(ledger) == LIVE


def test_retain_at_full_budget_evicts(benchmark: Any, filled: tuple[RetentionLedger, Clock, list[str]]) -> None:
    ledger, _, _ = filled
    ledger.budget_blocks = LIVE
    blocks = itertools.count(LIVE)
    benchmark(lambda: ledger.retain("r", [next(blocks)], DIGESTS, 16, 16))
    assert len(ledger) == LIVE and ledger.metrics()["evictions"] > 0
