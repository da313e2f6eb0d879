"""Retention grants as the connector's scheduler side applies them (issue 31, item 6): checked when vLLM first
asks about the request (its arrival), so a long answer is still retained; good for one request, so a grant
replayed on other requests retains and publishes nothing more.

vLLM's requests are stood in for by namespaces with the attributes the scheduler reads (as in
``tests/test_vllm_scheduler.py``); ``tests/e2e`` runs the connector inside real engines."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.metadata import ShuttleHandshake
from kvshuttle.integrations.vllm.scheduler import ShuttleScheduler
from kvshuttle.trust import GRANT_FIELD, GRANT_TTL_S, DeploymentSecret, issue_grant

BS = 16
SECRET = DeploymentSecret(b"grant-engine-tests-" * 3)
PUBLISH = "kvshuttle_publish_key"


def scheduler() -> ShuttleScheduler:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True}, model="m")
    s = ShuttleScheduler(config, "eng", BS, secret=SECRET)
    s.address = ShuttleHandshake("127.0.0.1", 5601)
    return s


def request(rid: str, params: dict[str, Any]) -> SimpleNamespace:
    prompt, output = list(range(1, 90)), [7, 8, 9]
    tokens = prompt + output
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, all_token_ids=tokens,
                           num_computed_tokens=len(tokens) - 1, kv_transfer_params=params,
                           status=SimpleNamespace(name="FINISHED_STOPPED"))


def run(s: ShuttleScheduler, rid: str, params: dict[str, Any], answer_s: float = 0.0) -> bool:
    """vLLM's calls for one decode request: admitted, then (``answer_s`` later) finished; whether it was kept."""
    req = request(rid, dict(params))
    s.get_num_new_matched_tokens(req, 0)
    if answer_s:
        with mock.patch("time.time", return_value=time.time() + answer_s):
            keep, _ = s.request_finished(req, [list(range(100, 106))])
    else:
        keep, _ = s.request_finished(req, [list(range(100, 106))])
    return keep


def test_a_long_answer_is_retained_when_its_grant_was_valid_on_arrival() -> None:
    """An hour of reasoning after a grant with a 300 s life: still retained (and published for a streaming
    router), because the grant is checked when the request arrives."""
    s = scheduler()
    params = {"remote_engine_id": "p", GRANT_FIELD: issue_grant(SECRET), PUBLISH: "k" * 24}
    assert run(s, "long", params, answer_s=GRANT_TTL_S + 3600.0)
    meta = s.build_connector_meta()
    assert len(meta.retains) == 1 and len(meta.publications) == 1 and meta.publications[0].params is not None
    assert "publish_refused_no_grant" not in s.counts


def test_a_replayed_grant_retains_nothing_more() -> None:
    s = scheduler()
    params = {"remote_engine_id": "p", GRANT_FIELD: issue_grant(SECRET), PUBLISH: "k" * 24}
    assert run(s, "first", params)
    assert not run(s, "replay-1", params) and not run(s, "replay-2", {**params, PUBLISH: "j" * 24})
    meta = s.build_connector_meta()
    assert [job.request_id for job in meta.retains] == ["first"]
    assert [p.request_id for p in meta.publications] == ["first"]  # no board entry for a replay either
    assert s.counts["retain_refused_no_grant"] == 2 and s.counts["publish_refused_no_grant"] == 2
    assert run(s, "fresh", {**params, GRANT_FIELD: issue_grant(SECRET)})
