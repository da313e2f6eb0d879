"""The error contract of the public core, policy and retention entry points, fuzzed.

Serving code calls these on every request and catches ``KVShuttleError``: whatever a caller (or a remote, through
a handle or a claim) passes, only ``KVShuttleError`` subclasses may come out, never a bare TypeError, ValueError,
OverflowError or IndexError; and a refused call changes nothing (destination bytes, ledger state).

Each case starts from a valid call and replaces one argument with a wrong type or an out-of-range value.
Deterministic (derandomized hypothesis, no example database) and a few seconds long.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import POISON, Geo, assert_bytes_equal, assert_caches_equal, make_cache, poisoned
from kvshuttle import (
    BlockIdError,
    KVShuttleError,
    LayoutError,
    PagedKVCache,
    StagingLayout,
    pack,
    staging_nbytes,
    unpack,
)
from kvshuttle.core.plan import SideGeometry, plan_read
from kvshuttle.policy import (
    Decision,
    KVHandle,
    PolicyConfig,
    PromptDigests,
    block_digests,
    decide,
    decide_from_params,
    parse_handle,
)
from kvshuttle.retention import RetentionArgumentError, RetentionLedger
from kvshuttle.trust import DeploymentSecret

GEO = Geo("flash_attn", "NHD", "float16", num_layers=2, num_blocks=8, block_size=4, num_heads=3, head_size=5)
FUZZ = settings(max_examples=120, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
HUGE = [2**63, 2**64, -(2**63) - 1, 10**400]
SPECIAL: list[Any] = [
    None, True, False, 40.5, -1, 0, -1.0, float("nan"), float("inf"), -float("inf"), "", "16", "NHD", b"\x00",
    [], [[0, 1]], [[0, 1], [2]], [1.5, 2.5], [None], ["a"], {}, {"a": 1}, (), object(), 1 + 2j, np.float64(3.0),
    np.int64(-1),
    np.uint64(2**64 - 1), np.bool_(True), np.array([1.5, 2.5]), np.array([[1, 2]]), np.array(["a"]),
    np.array([2**63], np.uint64), np.zeros(0), *HUGE,
]


def wrong() -> st.SearchStrategy[Any]:
    """Wrong types and out-of-range values (hypothesis picks, shrinks and explores integers and floats)."""
    return st.one_of(
        st.sampled_from(SPECIAL),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=4),
        st.lists(st.integers(-3, 2**64), max_size=4),
        st.lists(st.one_of(st.floats(), st.none(), st.text(max_size=2)), min_size=1, max_size=3),
    )


def named_or_ok(call: Callable[[], object]) -> bool:
    """Run ``call``: True if it succeeded, False if it raised a KVShuttleError that says something.

    Any other exception propagates: that is the escape the test exists to find.
    """
    try:
        call()
    except KVShuttleError as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return False
    return True


# ----------------------------------------------------------------------------------------- pack / unpack
COPY_ARGS = ("cache", "block_ids", "staging", "num_tokens", "layout", "head_offset", "stream", "backend")


@FUZZ
@given(direction=st.sampled_from(["pack", "unpack"]), backend=st.sampled_from(["native", "reference"]),
       arg=st.sampled_from(COPY_ARGS), value=wrong())
def test_pack_unpack_refuse_with_named_errors_and_touch_nothing(direction: str, backend: str, arg: str,
                                                                value: Any) -> None:
    host = make_cache(np.random.default_rng(0), GEO)
    staging = poisoned(4 * staging_nbytes(host.cache(), 12))
    kwargs: dict[str, Any] = {"cache": host.cache(), "block_ids": [2, 5, 7], "staging": staging, "num_tokens": 10,
                              "layout": None, "head_offset": 0, "stream": None, "backend": backend}
    kwargs[arg] = value
    cache_before, staging_before = host.snapshot(), staging.copy()
    if direction == "pack":
        ok = named_or_ok(lambda: pack(kwargs.pop("cache"), kwargs.pop("block_ids"), kwargs.pop("staging"), **kwargs))
    else:
        ok = named_or_ok(lambda: unpack(kwargs.pop("staging"), kwargs.pop("cache"), kwargs.pop("block_ids"),
                                        **kwargs))
    if not ok:
        assert_caches_equal(host.raws, cache_before, "cache after a refused call")
        assert_bytes_equal(staging, staging_before, "staging after a refused call")


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("num_tokens", [40.5, 10.0, True, np.float64(10), "10", [10]], ids=repr)
def test_a_token_count_that_is_not_an_int_is_a_block_id_error(backend: str, num_tokens: Any) -> None:
    """Never silently 40 (or 1): a count that is not an int is refused, before any byte moves."""
    host = make_cache(np.random.default_rng(1), GEO)
    staging = poisoned(staging_nbytes(host.cache(), 12))
    with pytest.raises(BlockIdError, match="num_tokens"):
        pack(host.cache(), [2, 5, 7], staging, num_tokens=num_tokens, backend=backend)  # type: ignore[arg-type]
    with pytest.raises(BlockIdError, match="num_tokens"):
        staging_nbytes(host.cache(), num_tokens)
    assert (staging == POISON).all()


def test_a_huge_int_in_a_message_is_still_a_named_error() -> None:
    """str() of an int of more than 4300 digits raises ValueError; messages must not try."""
    host = make_cache(np.random.default_rng(2), GEO)
    with pytest.raises(BlockIdError):
        pack(host.cache(), [2, 5, 7], poisoned(4096), num_tokens=10**5000)
    with pytest.raises(LayoutError):
        StagingLayout(10**5000, 3)
    with pytest.raises(RetentionArgumentError):
        RetentionLedger("e", "h", 1).retain("r", [0], [b"d"], 10**5000, 16)


# ------------------------------------------------------------------------------------- layout geometry
@FUZZ
@given(arg=st.sampled_from(["block_size", "num_heads", "order"]), value=wrong())
def test_staging_layout(arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"block_size": 4, "num_heads": 3, "order": "NHD"}
    kwargs[arg] = value
    if named_or_ok(lambda: StagingLayout(**kwargs)):
        layout = StagingLayout(**kwargs)
        assert type(layout.block_size) is int and type(layout.num_heads) is int


@FUZZ
@given(arg=st.sampled_from(["layers", "layer", "kind", "order"]), value=wrong())
def test_paged_cache_from_arrays(arg: str, value: Any) -> None:
    layers = make_cache(np.random.default_rng(3), GEO).layers
    kwargs: dict[str, Any] = {"layers": layers, "kind": "flash_attn", "order": None}
    if arg == "layer":
        kwargs["layers"] = [layers[0], value]
    else:
        kwargs[arg] = value
    named_or_ok(lambda: PagedKVCache.from_arrays(**kwargs))


@FUZZ
@given(arg=st.sampled_from(["kv_caches", "layer", "backend", "order"]), value=wrong())
def test_paged_cache_from_vllm(arg: str, value: Any) -> None:
    layers = make_cache(np.random.default_rng(3), GEO.with_(kind="vllm_cpu_attn")).layers
    kwargs: dict[str, Any] = {"kv_caches": dict(enumerate(layers)), "backend": "CPU_ATTN", "order": None}
    if arg == "layer":
        kwargs["kv_caches"] = {"a": layers[0], "b": value}
    else:
        kwargs[arg] = value
    named_or_ok(lambda: PagedKVCache.from_vllm(**kwargs))


@FUZZ
@given(arg=st.sampled_from(["cache", "num_tokens", "layout"]), value=wrong())
def test_staging_nbytes(arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"cache": make_cache(np.random.default_rng(4), GEO).cache(), "num_tokens": 10,
                              "layout": None}
    kwargs[arg] = value
    if named_or_ok(lambda: staging_nbytes(**kwargs)):
        assert type(staging_nbytes(**kwargs)) is int and staging_nbytes(**kwargs) >= 0


# ---------------------------------------------------------------------------------------- read planning
@FUZZ
@given(arg=st.sampled_from(["local", "local_ids", "remote", "remote_ids", "backend", "wire", "wire_field"]),
       field=st.sampled_from(["plane_bases", "planes_per_layer", "block_stride", "piece_bytes", "num_blocks",
                              "device_id"]),
       value=wrong())
def test_plan_read_and_side_geometry(arg: str, field: str, value: Any) -> None:
    side = SideGeometry.from_cache(make_cache(np.random.default_rng(5), GEO).cache())
    kwargs: dict[str, Any] = {"local": side, "local_ids": [0, 3], "remote": side, "remote_ids": [4, 1],
                              "backend": "auto"}
    if arg == "wire":
        named_or_ok(lambda: SideGeometry.from_wire(value))
    elif arg == "wire_field":
        wire = {**side.to_wire(), field: value}
        named_or_ok(lambda: SideGeometry.from_wire(wire))
    else:
        kwargs[arg] = value
        named_or_ok(lambda: plan_read(**kwargs))


# ------------------------------------------------------------------------------------------------- policy
B = 16
TOKENS = list(range(1, 101))


def good_handle() -> KVHandle:
    digests = tuple(block_digests(TOKENS, B))
    return KVHandle(engine_id="d", request_id="r", host="127.0.0.1", port=5600, block_ids=tuple(range(7)),
                    num_tokens=100, expiry_time=2e9, tp_size=1, handle_id="h", generation=0, block_size=B,
                    digests=digests, issued_at=1e9, ttl_s=480.0)


PARAM_FIELDS = tuple(good_handle().to_kv_transfer_params())
DECIDE_ARGS = ("prompt", "local_hit_tokens", "handle", "now_wall", "config", "clock_offset_s", "handle_field")
HANDLE_FIELDS = tuple(good_handle().__dict__)


@FUZZ
@given(arg=st.sampled_from(DECIDE_ARGS), field=st.sampled_from(HANDLE_FIELDS), value=wrong())
def test_decide(arg: str, field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"prompt": [*TOKENS, 7], "local_hit_tokens": 0, "handle": good_handle(),
                              "now_wall": 1e9, "config": PolicyConfig(threshold_tokens=1), "clock_offset_s": 0.0}
    if arg == "handle_field":  # a handle built by hand, never parsed: refused as a decision, never raised
        handle = KVHandle(**{**good_handle().__dict__, field: value})
        kwargs["handle"] = handle
        assert isinstance(decide(kwargs.pop("prompt"), **kwargs), Decision)
        return
    kwargs[arg] = value
    named_or_ok(lambda: decide(kwargs.pop("prompt"), **kwargs))


CONTRACT_SECRET = DeploymentSecret(b"error-contract-deployment-secret-00001")


@FUZZ
@given(field=st.sampled_from(PARAM_FIELDS), value=wrong(), local=st.sampled_from([0, 16, -1, 2.5, None]))
def test_parse_handle_and_decide_from_params(field: str, value: Any, local: Any) -> None:
    params = {**good_handle().to_kv_transfer_params(CONTRACT_SECRET), field: value}
    for kv_params in (params, value):
        for secret in (None, CONTRACT_SECRET):  # parsing alone, and parsing then authenticating
            named_or_ok(lambda p=kv_params, s=secret: parse_handle(p, secret=s, local_hit_tokens=local))
            named_or_ok(lambda p=kv_params, s=secret: decide_from_params(
                [*TOKENS, 7], p, local_hit_tokens=local, now_wall=1e9, config=PolicyConfig(threshold_tokens=1),
                secret=s))


CONFIG_FIELDS = ("kind", "threshold_tokens", "kv_bytes_per_token", "bandwidth_bytes_per_s", "transfer_overhead_s",
                 "prefill_tokens_per_s", "cost_margin", "expiry_margin_s", "extra_key")


@FUZZ
@given(arg=st.sampled_from(CONFIG_FIELDS), value=wrong(), kind=st.sampled_from(["fixed", "cost"]))
def test_policy_config(arg: str, value: Any, kind: str) -> None:
    kwargs: dict[str, Any] = {"kind": kind, "kv_bytes_per_token": 1e5, "bandwidth_bytes_per_s": 1e10,
                              "prefill_tokens_per_s": 1e4}
    kwargs[arg] = value
    if named_or_ok(lambda: PolicyConfig(**kwargs)):  # accepted: then it must decide without raising
        named_or_ok(lambda: decide([*TOKENS, 7], local_hit_tokens=0, handle=good_handle(), now_wall=1e9,
                                   config=PolicyConfig(**kwargs)))


@FUZZ
@given(arg=st.sampled_from(["token_ids", "block_size", "extra_key", "parent", "include_partial", "digest_size",
                            "hashes", "num_tokens"]),
       value=wrong())
def test_digests(arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"token_ids": TOKENS, "block_size": B, "extra_key": b"", "parent": None,
                              "include_partial": True, "digest_size": 16}
    if arg in ("hashes", "num_tokens"):
        hashes = {"hashes": block_digests(TOKENS, B, include_partial=False), "num_tokens": 100, arg: value}
        named_or_ok(lambda: PromptDigests.from_vllm_block_hashes(hashes["hashes"], B, hashes["num_tokens"]))
        return
    kwargs[arg] = value
    named_or_ok(lambda: block_digests(**kwargs))
    kwargs.pop("parent"), kwargs.pop("include_partial")
    named_or_ok(lambda: PromptDigests.from_tokens(**kwargs))


# ---------------------------------------------------------------------------------------------- retention
def _state(ledger: RetentionLedger) -> tuple[Any, ...]:
    """What a refused call must not change: live handles, retained blocks, their generations, open claims."""
    metrics = ledger.metrics()
    blocks = sorted(ledger.retained_block_ids())
    return (len(ledger), blocks, [ledger.generation(b) for b in range(12)], metrics["claims_in_flight"],
            metrics["pinned_blocks"], metrics["retained_blocks"])


def _ledger() -> tuple[RetentionLedger, KVHandle, str]:
    now = [100.0]
    ledger = RetentionLedger("e", "127.0.0.1", 5600, clock=lambda: now[0], wall_clock=lambda: 1e9)
    handle = ledger.retain("r1", [1, 2, 3], [b"a" * 16, b"b" * 16, b"c" * 16], 40, 16, conversation_id="c")
    claim = ledger.claim(handle.handle_id, handle.generation)
    return ledger, handle, claim.claim_id


LEDGER_CALLS = ("retain", "claim", "complete", "abort", "renew", "release", "close_conversation", "block_freed",
                "sweep", "get", "generation")
LEDGER_ARGS = ("engine_id", "host", "port", "ttl_s", "mode", "budget_blocks", "budget_bytes", "bytes_per_block",
               "claim_timeout_s", "clock", "wall_clock", "on_free", "tombstones")


def _ledger_call(ledger: RetentionLedger, handle: KVHandle, claim_id: str, call: str, position: int,
                 value: Any) -> Callable[[], object]:
    """``call`` with its argument number ``position`` (modulo its count) replaced by ``value``."""
    args: list[Any]
    kwargs: dict[str, Any] = {}
    if call == "retain":
        args = ["r2", [4, 5], [b"d" * 16, b"e" * 16], 20, 16, 1, "c2"]
        if position % 8 == 7:
            kwargs["ttl_s"] = value
    elif call == "claim":
        args = [handle.handle_id, handle.generation, list(handle.block_ids), list(handle.digests)]
        if position % 6 in (4, 5):
            kwargs["reader" if position % 6 == 4 else "readers"] = value
    elif call == "renew":
        args = [handle.handle_id, 60.0]
    elif call in ("complete", "abort"):
        args = [claim_id]
    elif call in ("block_freed", "generation"):
        args = [9]
    elif call == "sweep":
        args = [101.0]
    elif call == "close_conversation":
        args = ["c"]
    else:
        args = [handle.handle_id]
    if not kwargs:
        args[position % len(args)] = value
    return lambda: getattr(ledger, call)(*args, **kwargs)


@FUZZ
@given(call=st.sampled_from(LEDGER_CALLS), position=st.integers(0, 7), value=wrong())
def test_ledger_methods(call: str, position: int, value: Any) -> None:
    ledger, handle, claim_id = _ledger()
    before, metrics_before = _state(ledger), ledger.metrics()
    try:
        _ledger_call(ledger, handle, claim_id, call, position, value)()
    except RetentionArgumentError as exc:  # a caller bug: refused before anything changed, counters included
        assert str(exc)
        assert _state(ledger) == before and ledger.metrics() == metrics_before
    except KVShuttleError as exc:  # a refusal (unknown handle, tampered, ...): counted, but nothing else moves
        assert str(exc)
        assert _state(ledger) == before


@FUZZ
@given(arg=st.sampled_from(LEDGER_ARGS), value=wrong())
def test_ledger_constructor(arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"engine_id": "e", "host": "h", "port": 1, arg: value}
    if arg == "budget_bytes":
        kwargs["bytes_per_block"] = 1024
    if named_or_ok(lambda: RetentionLedger(**kwargs)):  # accepted: then it must work
        ledger = RetentionLedger(**kwargs)
        named_or_ok(lambda: ledger.retain("r", [0], [b"d"], 1, 16))
        named_or_ok(lambda: ledger.sweep())
        named_or_ok(lambda: ledger.release_all())
