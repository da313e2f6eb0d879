"""A black-holed decode costs each load its detection time, not the sum of everyone's: a real owner process
(a TransferEngine serving its cache) is frozen with SIGSTOP (its kernel still completes TCP connections, nothing
answers, nothing resets), and 16 reverse-read loads scheduled at once against it go through the real
ShuttleScheduler and ShuttleWorker (four loader threads, the reader's circuit breaker). Every load must come
back as a recompute (its target blocks reported invalid) within ~2 s of being scheduled; loads run one at a time
and reconnecting each would make the n-th wait ~n seconds.

Two cases: the worker was already connected to the decode when it froze (the heartbeat notices), and the first
contact happens after the freeze (the handshake never completes)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("zmq")

from kvshuttle.trust import SECRET_ENV
from test_connector_leaks import GEO, SECRET, EngineLoop, Req, remote_handle
from transfer_helpers import OwnerProcess, OwnerSpec

pytestmark = pytest.mark.timeout(180)

LOADS = 16
EXTRA_S = 2.0  # what a frozen decode may cost one load
SLACK_S = 1.0  # a loaded 2-core machine
SECRET_TEXT = "connector-leak-tests" * 2  # test_connector_leaks.SECRET's text: the owner process resolves it


@pytest.fixture
def owner(monkeypatch: pytest.MonkeyPatch) -> Iterator[OwnerProcess]:
    monkeypatch.setenv(SECRET_ENV, SECRET_TEXT)  # the spawned owner's deployment secret: the worker's
    with OwnerProcess([OwnerSpec(GEO, 31, {})]) as proc:
        try:
            yield proc
        finally:
            os.kill(proc.pid, signal.SIGCONT)


@pytest.fixture
def engine() -> Iterator[EngineLoop]:
    loop = EngineLoop({"kvshuttle_load_timeout_s": 10.0})  # the default: far above what a frozen peer may cost
    try:
        yield loop
    finally:
        loop.close()


def handle_at(owner: OwnerProcess) -> tuple[list[int], dict[str, Any]]:
    host, port = owner.addresses[0].removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1"
    history, params = remote_handle(int(port))
    return history, dict(params, do_remote_decode=True)


def loads_against(engine: EngineLoop, history: list[int], params: dict[str, Any], prefix: str,
                  count: int) -> dict[str, float]:
    """Schedule ``count`` loads in one step and step until all are reported: {request id: seconds from
    admission to report}."""
    ids = [f"{prefix}-{i}" for i in range(count)]
    for rid in ids:
        assert engine.admit(Req(rid, history, dict(params)))
    while engine.waiting:
        engine.step()
    results = dict(engine.load_results[-count:])
    assert set(results) == set(ids)
    return results


@pytest.mark.parametrize("connected", [True, False], ids=["connected-before", "first-contact-after"])
def test_sixteen_loads_against_a_frozen_decode_each_cost_at_most_two_seconds(
        owner: OwnerProcess, engine: EngineLoop, connected: bool) -> None:
    assert SECRET.fingerprint  # the worker's secret is the owner's (same text)
    history, params = handle_at(owner)
    if connected:  # one load while it answers: the owner keeps no ledger, so the claim is refused, fast
        (warm,) = loads_against(engine, history, params, "warm", 1).values()
        assert warm < 5.0
    os.kill(owner.pid, signal.SIGSTOP)
    costs = loads_against(engine, history, params, "frozen", LOADS)
    print(f"frozen decode ({'connected before' if connected else 'first contact after'}): per-load seconds from "
          f"scheduling to report: max {max(costs.values()):.2f}, "
          f"sorted {[round(c, 2) for c in sorted(costs.values())]}")
    assert max(costs.values()) < EXTRA_S + SLACK_S, "a load waited for others behind the frozen decode"
    reads = {k: v for k, v in engine.stats.items() if k.startswith("read.")}
    print(f"outcomes: {reads}")
    assert "read.fetched" not in reads and sum(reads.values()) == LOADS + connected
    assert engine.stats["decision.load_failed"] == LOADS + connected  # every load's blocks reported invalid
    assert all(failed for _, failed in engine.loaded) or not engine.loaded
