"""The connector's scheduler side on its own: decisions, loads, handles, and what it counts.

vLLM's request and block objects are stood in for by plain namespaces with the attributes the scheduler reads
(``requests.py`` names them); ``tests/e2e`` runs the same code inside real vLLM engines."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.metadata import ShuttleHandshake
from kvshuttle.integrations.vllm.scheduler import CONSUMED, ShuttleScheduler
from kvshuttle.policy import KVHandle, block_digests, parse_handle
from kvshuttle.trust import GRANT_FIELD, DeploymentSecret, issue_grant

BS = 32
SECRET = DeploymentSecret(b"scheduler-tests-" * 4)


def scheduler(cache_dtype: str = "bfloat16", **extra: Any) -> ShuttleScheduler:
    config = ShuttleConfig.from_extra({"bidirectional_kv_xfer": True, **extra}, model="m")
    s = ShuttleScheduler(config, "eng", BS, secret=SECRET, cache_dtype=cache_dtype)
    s.address = ShuttleHandshake("127.0.0.1", 5601)
    return s


def granted(params: dict[str, Any]) -> dict[str, Any]:
    """What a router of the deployment sends: the params plus its retention grant."""
    return {**params, GRANT_FIELD: issue_grant(SECRET)}


def request(rid: str, prompt: list[int], params: dict[str, Any] | None, *, output: list[int] = (),  # type: ignore[assignment]
            status: str = "FINISHED_STOPPED") -> SimpleNamespace:
    tokens = list(prompt) + list(output)
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(prompt), all_token_ids=tokens,
                           num_computed_tokens=max(len(tokens) - 1, 0), kv_transfer_params=params,
                           status=SimpleNamespace(name=status))


def decode_turn(s: ShuttleScheduler, tokens: list[int]) -> dict[str, Any]:
    """A decode request that finished holding ``tokens`` (prompt + answer); returns its kv_transfer_params."""
    req = request("d1", tokens[:-8], granted({"remote_engine_id": "p"}), output=tokens[-8:])
    keep, params = s.request_finished(req, [list(range(100, 100 + -(-(len(tokens) - 1) // BS)))])
    assert keep and params is not None
    return params


def words(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 30000, size=n)]


def test_a_finished_decode_request_is_retained_with_a_verifiable_handle() -> None:
    s = scheduler()
    tokens = words(300)
    params = decode_turn(s, tokens)
    handle = parse_handle(params, secret=SECRET)
    assert isinstance(handle, KVHandle)
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert handle.num_tokens == 299 and handle.block_ids == tuple(range(100, 110))
    assert list(handle.digests) == block_digests(tokens[:299], BS, extra_key=b"m")
    assert handle.expiry_time - time.time() > 470  # decoder_kv_blocks_ttl 480
    meta = s.build_connector_meta()
    (job,) = meta.retains
    assert (job.handle_id, job.block_ids, job.use_once) == (handle.handle_id, handle.block_ids, False)
    assert s.build_connector_meta().retains == []  # handed over once


def test_prefill_requests_are_retained_use_once_for_their_decode() -> None:
    s = scheduler(kv_lease_duration=7)
    req = request("p1", words(100), granted({"do_remote_decode": True, "do_remote_prefill": False}), output=[5])
    keep, params = s.request_finished(req, [[1, 2, 3, 4]])
    assert keep and params is not None and params["do_remote_prefill"] is True
    assert params["remote_num_tokens"] == 100 and params["kvshuttle_ttl_s"] == 7.0
    assert s.build_connector_meta().retains[0].use_once


def test_what_is_not_retained() -> None:
    s = scheduler()
    assert s.request_finished(request("a", words(50), None, output=[1]), [[1, 2]]) == (False, None)
    aborted = request("b", words(50), granted({"remote_engine_id": "p"}), output=[1], status="FINISHED_ABORTED")
    assert s.request_finished(aborted, [[1, 2]]) == (False, None)
    off = ShuttleScheduler(ShuttleConfig.from_extra({}), "eng", BS, secret=SECRET)  # bidirectional off
    off.address = ShuttleHandshake("h", 1)
    assert off.request_finished(request("c", words(50), granted({"remote_engine_id": "p"}), output=[1]),
                                [[1, 2]]) == (False, None)
    s.address = None  # the worker never reported where it serves
    assert s.request_finished(request("d", words(50), granted({"x": 1}), output=[1]), [[1, 2]]) == (False, None)


def test_a_continuation_loads_everything_verified_once() -> None:
    decode, prefill = scheduler(), scheduler()
    history = words(300)
    params = granted(dict(decode_turn(decode, history), do_remote_decode=True, do_remote_prefill=False))
    prompt = history + words(40, seed=1)
    req = request("p2", prompt, params)
    tokens, is_async = prefill.get_num_new_matched_tokens(req, 0)
    assert (tokens, is_async) == (299, True)
    assert prefill.get_num_new_matched_tokens(req, 0) == (299, True)  # pure: asking again changes nothing
    prefill.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 1, 4, 8, 2, 6, 5, 0, 11],)),
                                     299)
    (load,) = prefill.build_connector_meta().loads
    assert load.local_block_ids == (7, 3, 9, 1, 4, 8, 2, 6, 5, 0) and load.decision.fetch_tokens == 299
    assert req.kv_transfer_params[CONSUMED] and prefill.get_num_new_matched_tokens(req, 0) == (0, False)
    done = request("p2", prompt, params, output=[1])
    _, out = prefill.request_finished(done, [[7, 3, 9, 1, 4, 8, 2, 6, 5, 0, 11]])
    assert out is not None and out["kvshuttle_read_tokens"] == 299


def test_an_edited_history_loads_only_the_verified_prefix() -> None:
    decode, prefill = scheduler(), scheduler()
    history = words(300)
    params = dict(decode_turn(decode, history), do_remote_decode=True)
    edited = list(history)
    edited[100] += 1  # block 3
    assert prefill.get_num_new_matched_tokens(request("p", [*edited, 1, 2], params), 0) == (96, True)


def test_a_local_hit_comes_first_and_a_misaligned_one_recomputes() -> None:
    decode, prefill = scheduler(), scheduler()
    history = words(300)
    params = dict(decode_turn(decode, history), do_remote_decode=True)
    assert prefill.get_num_new_matched_tokens(request("p", [*history, 1], params), 64) == (299 - 64, True)
    small = ShuttleScheduler(ShuttleConfig.from_extra({"bidirectional_kv_xfer": True}, model="m"), "e", 16,
                             secret=SECRET)
    assert small.get_num_new_matched_tokens(request("q", [*history, 1], params), 16) == (0, False)
    assert small.counts["misaligned"] == 1


def test_a_handle_names_its_cache_dtype_and_another_cache_recomputes() -> None:
    """Bytes move as they are: an fp8 decode's blocks are never read into a bf16 prefill (nor e5m2 into e4m3);
    refused before any connection, counted under its own reason."""
    history = words(300)
    prompt = [*history, 1]
    params = granted(dict(decode_turn(scheduler("fp8_e4m3"), history), do_remote_decode=True))
    assert parse_handle(params, secret=SECRET).cache_dtype == "fp8_e4m3"  # type: ignore[union-attr]
    assert scheduler("fp8_e4m3").get_num_new_matched_tokens(request("a", prompt, params), 0) == (299, True)
    for other in ("bfloat16", "fp8_e5m2"):
        prefill = scheduler(other)
        assert prefill.get_num_new_matched_tokens(request("b", prompt, params), 0) == (0, False)
        assert prefill.take_stats().data["decision.cache_dtype_mismatch"] == 1


def test_a_handle_says_how_the_decode_lets_it_be_read() -> None:
    history = words(300)
    multi = parse_handle(decode_turn(scheduler(), history), secret=SECRET)
    once = parse_handle(decode_turn(scheduler(kvshuttle_reads="use_once"), history), secret=SECRET)
    assert multi.read_mode == "multi_read" and once.read_mode == "use_once"  # type: ignore[union-attr]


def test_refusals_recompute_and_are_counted() -> None:
    decode = scheduler(decoder_kv_blocks_ttl=3)  # inside the 5 s expiry margin already
    history = words(300)
    expiring = dict(decode_turn(decode, history), do_remote_decode=True)
    prefill = scheduler()
    prompt = [*history, 1]
    assert prefill.get_num_new_matched_tokens(request("a", prompt, expiring), 0) == (0, False)
    foreign = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "vllm"}
    assert prefill.get_num_new_matched_tokens(request("b", prompt, foreign), 0) == (0, False)
    off = ShuttleScheduler(ShuttleConfig.from_extra({}, model="m"), "e", BS, secret=SECRET)
    assert off.get_num_new_matched_tokens(request("c", prompt, expiring), 0) == (0, False)
    assert off.counts["bidir"] == 1
    tampered = dict(expiring, kvshuttle_digests="zz")
    assert prefill.get_num_new_matched_tokens(request("d", prompt, tampered), 0) == (0, False)
    stats = prefill.take_stats().data
    assert stats["decision.expired"] == 1 and stats["decision.foreign"] == 1
    assert stats["decision.malformed_handle"] == 1
    assert prefill.take_stats().data == {}  # counted once


def test_a_failed_load_is_not_reported_as_read() -> None:
    decode, prefill = scheduler(), scheduler()
    history = words(300)
    params = granted(dict(decode_turn(decode, history), do_remote_decode=True))
    req = request("p", [*history, 1, 2], params)
    tokens, _ = prefill.get_num_new_matched_tokens(req, 0)
    prefill.update_state_after_alloc(req, [list(range(20, 31))], tokens)
    prefill.update_connector_output(set(), {25})  # the worker reported block 25 invalid
    _, out = prefill.request_finished(request("p", [*history, 1, 2], params, output=[3]), [list(range(20, 31))])
    assert out is not None and out["kvshuttle_read_tokens"] == 0
    assert prefill.counts["load_failed"] == 1


def test_a_router_key_publishes_the_returned_params_for_the_worker_board() -> None:
    s = scheduler()
    tokens = words(300)
    req = request("d1", tokens[:-8], granted({"remote_engine_id": "p", "kvshuttle_publish_key": "route-7"}),
                  output=tokens[-8:])
    keep, params = s.request_finished(req, [list(range(100, 110))])
    meta = s.build_connector_meta()
    (pub,) = meta.publications
    assert keep and (pub.request_id, pub.key, pub.params) == ("d1", "route-7", params)
    assert s.build_connector_meta().publications == []  # handed over once


def test_a_request_that_retains_nothing_publishes_none_so_the_router_need_not_wait() -> None:
    s = scheduler()
    aborted = request("a", words(50), granted({"kvshuttle_publish_key": "route-8"}), output=[1],
                      status="FINISHED_ABORTED")
    assert s.request_finished(aborted, [[1, 2]]) == (False, None)
    (pub,) = s.build_connector_meta().publications
    assert (pub.key, pub.params) == ("route-8", None)


def test_a_publish_key_without_a_grant_publishes_nothing() -> None:
    """A client talking to vLLM directly cannot fill the decode's bounded board and push routers' entries out."""
    s = scheduler()
    tokens = words(300)
    req = request("d9", tokens[:-8], {"remote_engine_id": "p", "kvshuttle_publish_key": "flood-1"}, output=tokens[-8:])
    assert s.request_finished(req, [list(range(100, 110))]) == (False, None)
    assert s.build_connector_meta().publications == []
    assert s.counts["publish_refused_no_grant"] == 1


def test_a_malformed_router_key_is_not_published_and_counted() -> None:
    s = scheduler()
    params = decode_turn_with(granted({"remote_engine_id": "p", "kvshuttle_publish_key": "x" * 500}), s)
    assert params is not None  # the request itself is unaffected
    assert s.build_connector_meta().publications == []
    assert s.counts["publish_key"] == 1


def decode_turn_with(params: dict[str, Any], s: ShuttleScheduler) -> dict[str, Any] | None:
    tokens = words(100)
    _, out = s.request_finished(request("d2", tokens[:-4], params, output=tokens[-4:]), [[1, 2, 3, 4]])
    return out


# ------------------------------------------------------------------------------------ the trust boundary
def test_retention_needs_a_valid_grant_by_default() -> None:
    """A client talking to vLLM directly cannot make it hold memory: no grant, a forged one, an expired one, or
    one issued under another secret are all refused (counted, logged once); the request itself is unaffected."""
    s = scheduler()
    other = DeploymentSecret(b"another-deployment" * 2)
    tokens = words(100)
    grants = [None, "v1.9999999999.00", issue_grant(SECRET, now=time.time() - 3600), issue_grant(other)]
    for i, grant in enumerate(grants):
        params = {"remote_engine_id": "p"} if grant is None else {"remote_engine_id": "p", GRANT_FIELD: grant}
        req = request(f"r{i}", tokens[:-4], params, output=tokens[-4:])
        assert s.request_finished(req, [[1, 2, 3, 4]]) == (False, None)
    assert s.counts["retain_refused_no_grant"] == len(grants)
    assert s.build_connector_meta().retains == [] and s.state_sizes()["held"] == 0
    keep, out = s.request_finished(request("ok", tokens[:-4], granted({"remote_engine_id": "p"}),
                                           output=tokens[-4:]), [[1, 2, 3, 4]])
    assert keep and out is not None and GRANT_FIELD not in out  # the grant is never echoed to the client


def test_always_retains_without_a_grant_behind_vllms_own_proxy() -> None:
    s = scheduler(kvshuttle_retain="always")
    tokens = words(100)
    keep, out = s.request_finished(request("r", tokens[:-4], {"remote_engine_id": "p"}, output=tokens[-4:]),
                                   [[1, 2, 3, 4]])
    assert keep and out is not None and "retain_refused_no_grant" not in s.counts


def test_issued_handles_are_signed_and_only_this_deployment_accepts_them() -> None:
    params = decode_turn(scheduler(), words(300))
    assert isinstance(parse_handle(params, secret=SECRET), KVHandle)
    foreign = parse_handle(params, secret=DeploymentSecret(b"another-deployment" * 2))
    assert not isinstance(foreign, KVHandle) and foreign.reason.value == "unauthenticated_handle"


def test_a_forged_or_edited_handle_recomputes_and_is_counted() -> None:
    """Well-formed params whose digests match the prompt, but unsigned, signed by another secret, or edited
    after signing (another owner): recompute, no load is scheduled, the reason says why."""
    decode, prefill = scheduler(), scheduler()
    history = words(300)
    good = dict(decode_turn(decode, history), do_remote_decode=True)
    handle = parse_handle(good, secret=SECRET)
    assert isinstance(handle, KVHandle)
    other = DeploymentSecret(b"another-deployment" * 2)
    forged = [
        {**handle.to_kv_transfer_params(), "do_remote_decode": True},  # no MAC at all
        {**handle.to_kv_transfer_params(other), "do_remote_decode": True},  # signed by a non-member
        {**good, "remote_port": 6666},  # edited: the owner moved
        {**good, "kvshuttle_mac": "0" * 32},
    ]
    prompt = [*history, 1]
    for i, params in enumerate(forged):
        assert prefill.get_num_new_matched_tokens(request(f"f{i}", prompt, params), 0) == (0, False)
    assert prefill.counts["unauthenticated_handle"] == len(forged)
    assert prefill.build_connector_meta().loads == [] and prefill.state_sizes()["decisions"] == 0
    assert prefill.get_num_new_matched_tokens(request("g", prompt, good), 0) == (299, True)


def test_requests_whose_tokens_do_not_name_their_kv_neither_read_nor_keep() -> None:
    """Prompt embeddings (no token ids), multimodal inputs, LoRA adapters: digests over their token ids would vouch
    for the wrong KV, so they recompute and are not retained; none of them raises."""
    decode, s = scheduler(), scheduler()
    history = words(300)
    params = dict(decode_turn(decode, history), do_remote_decode=True)
    cases: list[dict[str, Any]] = [{"prompt_token_ids": None, "all_token_ids": [0] * 300, "prompt_embeds": object()},
                                   {"mm_features": [object()]}, {"lora_request": object()}]
    for i, extra in enumerate(cases):
        req = request(f"u{i}", [*history, 1], granted(dict(params)), output=[2])  # a grant is good for one request
        vars(req).update(extra)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        assert s.request_finished(req, [list(range(10))]) == (False, None)
    assert s.counts["unsupported"] == 2 * len(cases)
    assert s.build_connector_meta().retains == [] and all(v == 0 for v in s.state_sizes().values())


def test_a_cache_salt_goes_into_every_digest_so_a_handle_verifies_only_under_its_own_salt() -> None:
    """vLLM's cache_salt (the router sets one per tenant) isolates prefix caches; a reverse read must respect it:
    a handle issued for a salted request reads back only into a request with the same salt and tokens."""
    decode, prefill = scheduler(), scheduler()
    history = words(300)
    finished = request("d1", history[:-8], granted({"remote_engine_id": "p"}), output=history[-8:])
    finished.cache_salt = "tenant-a"
    keep, out = decode.request_finished(finished, [list(range(100, 110))])
    assert keep and out is not None
    salted = dict(out, do_remote_decode=True)
    unsalted = dict(decode_turn(scheduler(), history), do_remote_decode=True)
    for i, (salt, params, reads) in enumerate([("tenant-a", salted, True), ("tenant-b", salted, False),
                                               (None, salted, False), ("tenant-a", unsalted, False),
                                               (None, unsalted, True)]):
        req = request(f"s{i}", [*history, 1], dict(params))
        req.cache_salt = salt
        tokens, _ = prefill.get_num_new_matched_tokens(req, 0)
        assert (tokens > 0) is reads, (salt, i)
    assert prefill.counts["nothing_verified"] == 3


def test_a_load_carries_the_authenticated_handle_and_when_it_was_decided() -> None:
    decode, prefill = scheduler(), scheduler()
    history = words(300)
    params = dict(decode_turn(decode, history), do_remote_decode=True)
    req = request("p", [*history, 1, 2], params)
    tokens, _ = prefill.get_num_new_matched_tokens(req, 0)
    before = time.monotonic()
    prefill.update_state_after_alloc(req, [list(range(20, 31))], tokens)
    (load,) = prefill.build_connector_meta().loads
    assert load.handle == parse_handle(params, secret=SECRET) and not load.failure
    assert before <= load.decided_at <= time.monotonic()


def test_a_load_vllm_waits_for_without_a_decision_is_reported_failed() -> None:
    """vLLM says it allocated external tokens this side never promised: the load is queued as failed (the
    worker reports it at once, its blocks invalid) rather than never reported (vLLM would wait forever)."""
    s = scheduler()
    req = request("x", words(100), {"kvshuttle_version": 2})
    s.update_state_after_alloc(req, [[4, 5, 6, 7]], 64)
    (load,) = s.build_connector_meta().loads
    assert load.failure and load.handle is None and load.local_block_ids == (4, 5)
