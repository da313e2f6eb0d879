"""No connector hook can take vLLM down: whatever a hook meets (a prompt-embeds request, a malformed request
object, a bug inside kvshuttle), the facade answers safely (recompute, not retained, empty metadata), logs the
failure once per kind with the request id, counts it in the connector stats, and leaves no per-request state
behind. Where vLLM already waits on this side (an asynchronous load it was promised), the load is still
reported, failed, so vLLM recomputes instead of waiting forever.

The facade is built around a real ShuttleScheduler (and a stub worker) without vLLM, as in
tests/test_vllm_scheduler.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.connector import KVShuttleConnector
from kvshuttle.integrations.vllm.metadata import ShuttleHandshake, ShuttleMetadata
from kvshuttle.integrations.vllm.scheduler import ShuttleScheduler
from kvshuttle.trust import GRANT_FIELD, DeploymentSecret, issue_grant
from test_vllm_scheduler import BS, decode_turn, request, words

SECRET = DeploymentSecret(b"scheduler-tests-" * 4)  # test_vllm_scheduler's, so its handles verify here
HOOKS_LOG = "vllm.kvshuttle"


def facade(**extra: Any) -> tuple[KVShuttleConnector, ShuttleScheduler]:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **extra}, model="m")
    s = ShuttleScheduler(config, "eng", BS, secret=SECRET)
    s.address = ShuttleHandshake("127.0.0.1", 5601)
    c = KVShuttleConnector.__new__(KVShuttleConnector)  # no vLLM: skip the base class's constructor
    c._attach(s, None)
    return c, s


def a_handle() -> dict[str, Any]:
    decoder, _ = facade()
    assert decoder._scheduler is not None
    return dict(decode_turn(decoder._scheduler, words(300)), do_remote_decode=True)


def errors(caplog: pytest.LogCaptureFixture, hook: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and hook in r.getMessage()]


def test_a_prompt_embeds_request_with_a_handle_recomputes() -> None:
    """prompt_token_ids is None for prompt embeddings: the handle cannot be verified against it."""
    c, s = facade()
    history = words(300)
    req = request("e1", history, {**a_handle(), GRANT_FIELD: issue_grant(SECRET)}, output=[5])
    req.prompt_token_ids = None
    req.prompt_embeds = object()
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    c.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 0)
    assert c.request_finished(req, [list(range(10))]) == (False, None)
    meta = c.build_connector_meta(None)
    assert isinstance(meta, ShuttleMetadata) and not (meta.loads or meta.retains)
    assert all(v == 0 for v in s.state_sizes().values())


@pytest.mark.parametrize("bad", [
    SimpleNamespace(request_id="r1"),  # no attributes at all
    SimpleNamespace(request_id="r2", kv_transfer_params=["not", "a", "dict"], prompt_token_ids=[1, 2]),
    SimpleNamespace(request_id="r3", kv_transfer_params={"kvshuttle_version": 2, "remote_host": object()},
                    prompt_token_ids="abc"),
    object(),
])
def test_malformed_request_objects_get_the_safe_answers(bad: Any) -> None:
    c, s = facade()
    assert c.get_num_new_matched_tokens(bad, 0) == (0, False)
    c.update_state_after_alloc(bad, None, 0)
    assert c.request_finished(bad, None) == (False, None)
    c.update_connector_output(SimpleNamespace(finished_sending={"nobody"}, invalid_block_ids={1}))
    assert isinstance(c.build_connector_meta(None), ShuttleMetadata)
    assert all(v == 0 for v in s.state_sizes().values())


def test_every_scheduler_hook_that_raises_answers_safely_logs_once_and_counts(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    c, s = facade()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug inside kvshuttle")

    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "request_finished", "update_connector_output", "take_stats"):
        monkeypatch.setattr(s, name, boom)
    req = request("req-17", words(100), a_handle(), output=[1])
    caplog.set_level(logging.DEBUG, logger=HOOKS_LOG)
    for _ in range(2):
        assert c.get_num_new_matched_tokens(req, 0) == (0, False)
        c.update_state_after_alloc(req, [[1, 2, 3, 4]], 0)
        meta = c.build_connector_meta(None)
        assert isinstance(meta, ShuttleMetadata) and meta.loads == [] and meta.retains == []
        assert c.request_finished(req, [[1, 2, 3, 4]]) == (False, None)
        c.update_connector_output(SimpleNamespace(finished_sending=None, invalid_block_ids=None))
        c.set_xfer_handshake_metadata(None)  # type: ignore[arg-type]  # not a dict: .get raises
    stats = c.get_kv_connector_stats()  # take_stats raises too: only the guard's counts come back
    assert stats is not None
    for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "request_finished", "update_connector_output", "set_xfer_handshake_metadata"):
        assert stats.data[f"hook_error.{hook}"] == 2, hook
        (record,) = errors(caplog, hook + " failed")  # logged once per kind, with its traceback
        assert record.exc_info is not None
    assert stats.data["hook_error.get_kv_connector_stats"] == 1
    assert "req-17" in errors(caplog, "request_finished failed")[0].getMessage()  # the request is named
    again = c.get_kv_connector_stats()
    assert again is not None and again.data == {"hook_error.get_kv_connector_stats": 1}  # counted once each


def test_a_failing_request_finished_leaves_no_state_and_tells_a_waiting_router(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler decides everything before it commits a retention, so a failure keeps nothing: vLLM frees
    the blocks, no RetainJob goes out, and a streaming router's publication says "nothing retained"."""
    c, s = facade()
    history = words(300)
    req = request("p1", [*history, 1], {**a_handle(), "kvshuttle_publish_key": "route-1",
                                         GRANT_FIELD: issue_grant(SECRET)}, output=[2])
    tokens, _ = c.get_num_new_matched_tokens(req, 0)
    assert tokens == 299
    c.update_state_after_alloc(req, [list(range(20, 31))], tokens)
    monkeypatch.setattr("kvshuttle.integrations.vllm.scheduler.block_digests",
                        lambda *a, **k: (_ for _ in ()).throw(MemoryError("digest")))
    assert c.request_finished(req, [list(range(20, 31))]) == (False, None)
    meta = c.build_connector_meta(None)
    assert meta.retains == [] and [(p.key, p.params) for p in meta.publications] == [("route-1", None)]
    assert len(meta.loads) == 1  # the load itself was scheduled before and still goes out
    assert s.update_connector_output(None, None, {"p1"}) == (set(), {"p1"})  # reported: vLLM sees it
    assert all(v == 0 for v in s.state_sizes().values())


def test_a_load_vllm_waits_for_is_reported_failed_when_scheduling_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """get_num_new_matched_tokens promised tokens (vLLM now waits in WAITING_FOR_REMOTE_KVS); scheduling the
    load then raises: a failed LoadJob still goes to the worker, naming the blocks vLLM must recompute."""
    c, _ = facade()
    history = words(300)
    req = request("p2", [*history, 1], a_handle())
    tokens, is_async = c.get_num_new_matched_tokens(req, 0)
    assert (tokens, is_async) == (299, True)
    monkeypatch.setattr("kvshuttle.integrations.vllm.scheduler.LoadJob",
                        _raise_first_then_real(RuntimeError("scheduling broke")))
    c.update_state_after_alloc(req, [list(range(40, 51))], tokens)
    (load,) = c.build_connector_meta(None).loads
    assert load.failure and load.handle is None and load.local_block_ids == tuple(range(40, 50))
    stats = c.get_kv_connector_stats()
    assert stats is not None and stats.data["hook_error.update_state_after_alloc"] == 1


def _raise_first_then_real(exc: Exception) -> Any:
    from kvshuttle.integrations.vllm.metadata import LoadJob

    calls = {"n": 0}

    def make(*args: Any, **kwargs: Any) -> LoadJob:
        calls["n"] += 1
        if calls["n"] == 1:
            raise exc
        return LoadJob(*args, **kwargs)

    return make


class _BrokenWorker:
    def start(self, meta: Any) -> None:
        raise RuntimeError("start broke")

    def finished(self, ids: Any) -> Any:
        raise RuntimeError("finished broke")

    def load_errors(self) -> set[int]:
        raise RuntimeError("load_errors broke")

    def take_stats(self) -> Any:
        raise RuntimeError("take_stats broke")

    def shutdown(self) -> None:
        raise RuntimeError("shutdown broke")


def test_worker_hooks_that_raise_answer_safely() -> None:
    c = KVShuttleConnector.__new__(KVShuttleConnector)
    c._attach(None, _BrokenWorker())  # type: ignore[arg-type]
    c._get_connector_metadata = lambda: ShuttleMetadata()  # type: ignore[method-assign]
    c.start_load_kv(None)
    assert c.get_finished({"a"}) == (None, None)
    assert c.get_block_ids_with_load_errors() == set()
    c.shutdown()
    stats = c.get_kv_connector_stats()
    assert stats is not None and {k: v for k, v in stats.data.items()} == {
        "hook_error.start_load_kv": 1, "hook_error.get_finished": 1, "hook_error.get_block_ids_with_load_errors": 1,
        "hook_error.shutdown": 1, "hook_error.get_kv_connector_stats": 1}


def test_reports_vllm_would_assert_on_are_not_passed_on() -> None:
    """finished_sending for a request never kept, or a second finished_recving for a load: vLLM asserts on
    either (the EngineCore dies). The facade passes on only what this side vouches for."""
    c, s = facade()
    history = words(300)
    req = request("p3", [*history, 1], a_handle())
    tokens, _ = c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, [list(range(40, 51))], tokens)
    kept = request("d3", words(100), {"remote_engine_id": "p", GRANT_FIELD: issue_grant(SECRET)}, output=[1, 2])
    assert c.request_finished(kept, [[1, 2, 3, 4]])[0]
    out = SimpleNamespace(finished_sending={"d3", "never-kept"}, finished_recving={"p3", "never-loaded"},
                          invalid_block_ids=set())
    c.update_connector_output(out)
    assert (out.finished_sending, out.finished_recving) == ({"d3"}, {"p3"})
    again = SimpleNamespace(finished_sending={"d3"}, finished_recving={"p3"}, invalid_block_ids=set())
    c.update_connector_output(again)  # reported twice: the second report would free or admit twice
    assert (again.finished_sending, again.finished_recving) == (None, None)
    assert s.counts["stray_report"] == 4
