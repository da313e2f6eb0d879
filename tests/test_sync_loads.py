"""A synchronous (layer-pipelined) load's blocks stay out of vLLM's prefix cache until the load landed
(``integrations/vllm/sync_loads.py``), and the step that waits on such loads is bounded once, not per load
(``integrations/vllm/layered.py``).

The guard runs here against :class:`PrefixCacheDouble` (vLLM's prefix cache as the connector sees it);
``tests/e2e/test_vllm_layered.py`` runs it in real engines, against vLLM's own scheduler and cache."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from kvshuttle.integrations.vllm import ShuttleConfig, layered
from kvshuttle.integrations.vllm.layered import SETTLE_GRACE_S, LayeredLoads
from kvshuttle.integrations.vllm.metadata import LoadJob, ShuttleWorkerMeta
from kvshuttle.integrations.vllm.scheduler import ShuttleScheduler
from kvshuttle.integrations.vllm.sync_loads import SyncLoadGuard
from kvshuttle.policy import Decision
from kvshuttle.policy.decision import Reason
from kvshuttle.reuse import ReuseResult
from kvshuttle.transfer import LayerProgress
from prefix_cache_double import PrefixCacheDouble
from test_vllm_scheduler import SECRET, granted, request, words

BS = 16
TABLE = [7, 3, 12, 30, 21, 4, 9, 40]  # local hit: blocks 0-1; the load writes 2-5; this step computes 6 and part of 7
LOADED = TABLE[2:6]
PROMPT = 7 * BS + 5


def held(tp_size: int = 1, enabled: bool = True) -> tuple[SyncLoadGuard, PrefixCacheDouble, SimpleNamespace]:
    cache = PrefixCacheDouble(BS, enabled)
    cache.allocate("r", TABLE, PROMPT)  # vLLM caches at allocation: blocks 0-6 (7 is partial)
    req = SimpleNamespace(request_id="r", num_preemptions=0, status=SimpleNamespace(name="RUNNING"))
    guard = SyncLoadGuard(cache, BS, tp_size)
    guard.hold(req, 2, LOADED)
    return guard, cache, req


def test_held_blocks_are_no_prefix_hit_until_the_load_landed() -> None:
    guard, cache, _ = held()
    assert cache.cached == set(TABLE[:2])  # the local hit stays; loaded and computed-from-them blocks are out
    guard.settle({}, set())  # a step that did not report this load
    assert cache.cached == set(TABLE[:2]) and len(guard) == 1
    guard.settle({"r": 1}, set())
    assert cache.cached == set(TABLE[:7]) and cache.counts["r"] == 7 and len(guard) == 0


def test_a_failed_load_keeps_its_blocks_out_and_the_recompute_caches_each_block_as_it_rewrites_it() -> None:
    guard, cache, req = held()
    guard.settle({}, {LOADED[1]})
    assert cache.cached == set(TABLE[:2]) and cache.counts["r"] == 2 and len(guard) == 0
    cache.cache(req, 4 * BS)  # vLLM's next allocation: a chunk of the recompute, blocks 2-3
    assert cache.cached == set(TABLE[:4])


def test_a_failure_after_later_steps_cached_more_takes_those_out_too() -> None:
    guard, cache, _ = held()
    cache.cached.add(TABLE[7])  # asynchronous scheduling cached block 7 (the next step's tokens) meanwhile
    guard.settle({}, {LOADED[0]})
    assert cache.cached == set(TABLE[:2])


def test_with_tensor_parallelism_every_rank_must_say_landed() -> None:
    guard, cache, _ = held(tp_size=2)
    guard.settle({"r": 1}, set())
    assert cache.cached == set(TABLE[:2])
    meta = ShuttleWorkerMeta(set(), {"r": 1}).aggregate(ShuttleWorkerMeta(set(), {"r": 1}))
    guard.settle(meta.landed, set())
    assert cache.cached == set(TABLE[:7])


def test_a_normal_finish_in_the_loads_own_step_confirms_it_an_abort_does_not() -> None:
    guard, cache, req = held()
    req.status = SimpleNamespace(name="FINISHED_STOPPED")
    guard.finished(req)
    assert cache.cached == set(TABLE[:7])
    guard, cache, req = held()
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    guard.finished(req)
    guard.settle({"r": 1}, set())  # (the report comes after the abort: nothing is held any more)
    assert cache.cached == set(TABLE[:2]) and guard.counts["dropped"] == 1


def test_a_request_preempted_before_its_outcome_caches_nothing() -> None:
    guard, cache, req = held()
    cache.free("r")  # preempted (asynchronous scheduling: before this step's output came)
    req.num_preemptions = 1
    cache.allocate("r", [50, 51], 0)  # readmitted, computing from scratch
    guard.settle({"r": 1}, set())
    assert cache.cached == set(TABLE[:2]) and guard.counts["dropped"] == 1


def test_an_engine_without_prefix_caching_holds_nothing() -> None:
    guard, cache, _ = held(enabled=False)
    assert len(guard) == 0 and not cache.cached


# ------------------------------------------------------------------------------------------- the scheduler
def _scheduler(**extra: Any) -> ShuttleScheduler:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, "kvshuttle_load_mode": "layered", **extra},
                                      model="m")
    s = ShuttleScheduler(config, "p", BS, secret=SECRET, num_layers=4)
    from kvshuttle.integrations.vllm.metadata import ShuttleHandshake

    s.address = ShuttleHandshake("127.0.0.1", 5601)
    return s


@pytest.mark.parametrize("bound", [False, True])
def test_a_layered_load_needs_the_guard_and_is_held_by_it(bound: bool) -> None:
    s = _scheduler()
    history = words(200)
    finished = request("d1", history[:-8], granted({"remote_engine_id": "p"}), output=history[-8:])
    keep, params = s.request_finished(finished, [list(range(100, 113))])
    assert keep and params is not None
    cache = PrefixCacheDouble(BS)
    if bound:
        s.bind_prefix_cache(cache)
    req = request("t2", [*history[:199], *words(40, seed=9)], dict(params), status="RUNNING")
    tokens, asynchronous = s.get_num_new_matched_tokens(req, 0)
    assert tokens > 0 and asynchronous is not bound  # unbound: read asynchronously, vLLM delays the caching
    table = list(range(200, 216))
    cache.allocate("t2", table, len(req.prompt_token_ids))
    s.update_state_after_alloc(req, [table], tokens)
    assert s.build_connector_meta().loads[0].layered is bound
    assert (cache.cached == set()) is bound  # held: not one block of the request is a prefix hit
    s.update_connector_output(None, None, landed={"t2": 1})
    assert cache.cached == set(table[:239 // BS])
    assert s.state_sizes()["sync_loads"] == 0


# -------------------------------------------------------------------------------- the step's bound (item 4)
def test_many_stuck_layered_loads_hold_the_step_once_not_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layered, "LOAD_THREAD_GRACE_S", 0.5)  # (5 s in service: threads that never return are bugs)
    loads = LayeredLoads({"l0": 0, "l1": 1}, 2)
    deadline = time.monotonic() + 0.3
    decision = Decision("fetch", Reason.FETCH, "t", fetch_tokens=BS, reused_tokens=BS, fetch_blocks=range(1),
                        remote_block_ids=(0,), block_size=BS)
    for k in range(6):  # six owners that never answer: their loads' futures never complete
        job = LoadJob(f"r{k}", None, decision, (k,), BS, time.monotonic(), layered=True)
        loads.add(job, Future[ReuseResult](), LayerProgress(2), deadline)
    t0 = time.monotonic()
    loads.wait_layer("l0")
    loads.wait_layer("l1")
    settled = loads.settle()
    took = time.monotonic() - t0
    assert [job.request_id for job, _ in settled] == [f"r{k}" for k in range(6)]
    assert all(result.invalid_block_ids == (k,) for k, (_, result) in enumerate(settled))
    assert took < 0.3 + SETTLE_GRACE_S + 0.5 + 1.0, took  # one deadline and one grace, not six graces


def test_a_failed_load_whose_read_nixl_could_not_cancel_holds_the_step_until_the_read_is_over() -> None:
    """vLLM recomputes a failed synchronous load's blocks in its next step: a READ still in flight must be over
    first (``ReuseResult.settled``; tests/test_quarantine.py shows NIXL lands such READs after a release)."""
    import threading
    from dataclasses import replace

    from kvshuttle.integrations.vllm.layered import load_failure
    from kvshuttle.reuse import Failure
    from kvshuttle.transfer import Settlement

    loads = LayeredLoads({"l0": 0}, 1)
    decision = Decision("fetch", Reason.FETCH, "t", fetch_tokens=BS, reused_tokens=BS, fetch_blocks=range(1),
                        remote_block_ids=(0,), block_size=BS)
    job = LoadJob("r", None, decision, (3,), BS, time.monotonic(), layered=True)
    in_flight = Settlement()
    future = Future[ReuseResult]()
    future.set_result(replace(load_failure(job, Failure.TRANSFER_TIMEOUT, "stalled"), settled=in_flight))
    loads.add(job, future, LayerProgress(1), time.monotonic() + 0.1)
    threading.Timer(0.8, in_flight.settle).start()
    t0 = time.monotonic()
    ((_, result),) = loads.settle()
    assert time.monotonic() - t0 >= 0.7 and in_flight.done() and result.invalid_block_ids == (3,)
    assert loads.quarantine_wait_s >= 0.7


def _layered_turn(s: ShuttleScheduler, cache: PrefixCacheDouble, rid: str) -> tuple[SimpleNamespace, list[int], int]:
    """A decode's finished turn, then the next turn's prefill request admitted with a layered load decision."""
    history = words(200, seed=len(rid))
    finished = request(f"d-{rid}", history[:-8], granted({"remote_engine_id": "p"}), output=history[-8:])
    keep, params = s.request_finished(finished, [list(range(100, 113))])
    assert keep and params is not None
    req = request(rid, [*history[:199], *words(40, seed=9)], dict(params), status="RUNNING")
    tokens, asynchronous = s.get_num_new_matched_tokens(req, 0)
    table = list(range(200, 216))
    cache.allocate(rid, table, len(req.prompt_token_ids))
    return req, table, tokens if not asynchronous else -tokens


def test_a_layered_load_vllm_waits_for_without_a_plan_is_held_too() -> None:
    """update_state_after_alloc failed (a bug): fail_load reports the load failed, and its blocks, cached at
    allocation, are held out like any other layered load's."""
    s, cache = _scheduler(), PrefixCacheDouble(BS)
    s.bind_prefix_cache(cache)
    req, table, tokens = _layered_turn(s, cache, "t3")
    assert tokens > 0
    s.fail_load(req, [table], tokens, "a bug")
    assert cache.cached == set() and s.build_connector_meta().loads[0].failure == "a bug"
    s.update_connector_output(None, set(table[:12]))
    assert cache.cached == set() and cache.counts["t3"] == 0


def test_a_prefix_cache_that_refuses_the_guard_turns_layered_loads_off() -> None:
    class Refusing(PrefixCacheDouble):
        def uncache(self, block_ids: Any) -> None:
            raise RuntimeError("not the vLLM compat knows")

    s, cache = _scheduler(), Refusing(BS)
    s.bind_prefix_cache(cache)
    req, table, tokens = _layered_turn(s, cache, "t4")
    with pytest.raises(RuntimeError):
        s.update_state_after_alloc(req, [table], tokens)
    assert s.sync_loads is None and s.counts["sync_loads_broken"] == 1
    s.fail_load(req, [table], tokens, "the hook raised")  # what the facade does next
    assert s.build_connector_meta().loads[0].failure == "the hook raised"
    _, _, later = _layered_turn(s, cache, "t5")
    assert later < 0  # read asynchronously from now on
