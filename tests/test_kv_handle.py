"""The handle's kv_transfer_params wire format: round trip, vLLM field names, strict parsing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshuttle.policy import HandleAuthError, HandleFormatError, KVHandle, Reason, parse_handle
from kvshuttle.trust import DeploymentSecret


def handle(blocks: int = 5, tokens: int = 70) -> KVHandle:
    return KVHandle(engine_id="decode-0", request_id="req-1", host="127.0.0.1", port=5600,
                    block_ids=tuple(range(100, 100 + blocks)), num_tokens=tokens, expiry_time=1_700_000_480.5,
                    tp_size=2, handle_id="h-Zx81", generation=7, block_size=16,
                    digests=tuple(bytes([k]) * 16 for k in range(blocks)), issued_at=1_700_000_000.5, ttl_s=480.0)


def test_round_trip_through_json() -> None:
    original = handle()
    params = json.loads(json.dumps(original.to_kv_transfer_params()))
    assert KVHandle.from_kv_transfer_params(params, None) == original


def test_cache_dtype_and_read_mode_travel() -> None:
    """What the blocks' bytes mean and how the retention may be read come with the handle: a reader refuses another
    dtype without connecting, and a router follows the decode's read mode instead of being configured to match."""
    original = KVHandle(**{**handle().__dict__, "cache_dtype": "fp8_e4m3", "read_mode": "use_once"})
    params = json.loads(json.dumps(original.to_kv_transfer_params()))
    assert (params["kvshuttle_cache_dtype"], params["kvshuttle_reads"]) == ("fp8_e4m3", "use_once")
    parsed = KVHandle.from_kv_transfer_params(params, None)
    assert (parsed.cache_dtype, parsed.read_mode) == ("fp8_e4m3", "use_once")
    assert handle().read_mode == "multi_read" and handle().cache_dtype == ""


def test_vllm_field_names_carry_the_same_meaning() -> None:
    params = handle().to_kv_transfer_params()
    assert params["remote_block_ids"] == list(range(100, 105))
    assert (params["remote_engine_id"], params["remote_request_id"]) == ("decode-0", "req-1")
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("127.0.0.1", 5600, 2)
    assert params["remote_num_tokens"] == 70 and params["remote_blocks_expiry_time"] == 1_700_000_480.5
    assert all(k.startswith(("remote_", "tp_size", "kvshuttle_")) for k in params)


def test_empty_handle_round_trips() -> None:
    empty = KVHandle(**{**handle().__dict__, "block_ids": (), "digests": (), "num_tokens": 0})
    assert KVHandle.from_kv_transfer_params(empty.to_kv_transfer_params(), None) == empty


@pytest.mark.parametrize(("field", "value"), [
    ("remote_port", True),  # a bool is not a port
    ("remote_port", 70000),
    ("remote_block_ids", [100, 101, 101, 103, 104]),
    ("remote_block_ids", [100, -1, 102, 103, 104]),
    ("remote_block_ids", "100,101"),
    ("remote_num_tokens", 90),  # more than 5 blocks of 16 hold
    ("remote_num_tokens", 64),  # the last block would be empty
    ("remote_blocks_expiry_time", float("nan")),
    ("kvshuttle_version", 1),  # before every field was MAC'd
    ("kvshuttle_generation", -1),
    ("kvshuttle_digests", "xyz"),
    ("kvshuttle_digest_size", 15),
    ("kvshuttle_handle_id", ""),
    ("kvshuttle_block_size", 0),
    ("kvshuttle_cache_dtype", "fp8 e4m3"),  # a dtype name has no spaces
    ("kvshuttle_cache_dtype", "x" * 33),
    ("kvshuttle_cache_dtype", 8),
    ("kvshuttle_reads", "multi"),  # the router's old word is not a handle's
    ("kvshuttle_reads", ""),
    ("kvshuttle_version", 3),  # before the cache dtype and read mode travelled
])
def test_malformed_params_are_named_errors(field: str, value: Any) -> None:
    params = handle().to_kv_transfer_params()
    params[field] = value
    with pytest.raises(HandleFormatError):
        KVHandle.from_kv_transfer_params(params, None)


@pytest.mark.parametrize("missing", ["remote_block_ids", "remote_engine_id", "kvshuttle_digests", "kvshuttle_version",
                                     "kvshuttle_cache_dtype", "kvshuttle_reads"])
def test_missing_fields_are_named_errors(missing: str) -> None:
    params = handle().to_kv_transfer_params()
    del params[missing]
    with pytest.raises(HandleFormatError, match=missing):
        KVHandle.from_kv_transfer_params(params, None)


def test_not_a_dict() -> None:
    with pytest.raises(HandleFormatError):
        KVHandle.from_kv_transfer_params(["remote_block_ids"], None)


# ---------------------------------------------------------------------------- every malformed field
@pytest.mark.parametrize(("field", "value"), [
    ("remote_blocks_expiry_time", 10**400),  # an int too large for a float: OverflowError before
    ("remote_blocks_expiry_time", float("inf")),
    ("remote_blocks_expiry_time", "1700000480.5"),
    ("remote_blocks_expiry_time", True),
    ("kvshuttle_issued_at", float("-inf")),
    ("kvshuttle_issued_at", None),
    ("kvshuttle_ttl_s", float("nan")),
    ("kvshuttle_ttl_s", -1.0),
    ("kvshuttle_ttl_s", 10**400),
    ("remote_port", 0),
    ("remote_port", -5600),
    ("remote_port", 10**400),
    ("remote_port", 5600.0),
    ("tp_size", 0),
    ("tp_size", 2**63),
    ("tp_size", False),
    ("kvshuttle_generation", 2**63),
    ("kvshuttle_generation", 7.0),
    ("kvshuttle_block_size", 2**63),
    ("kvshuttle_block_size", -16),
    ("kvshuttle_block_size", 16.0),
    ("kvshuttle_version", True),  # == 1, but a bool
    ("kvshuttle_version", 10**400),
    ("remote_num_tokens", 10**400),
    ("remote_num_tokens", 70.0),
    ("remote_num_tokens", True),
    ("remote_block_ids", [100, 101, 102, 103, 2**63]),
    ("remote_block_ids", [100, 101, 102, 103, 10**400]),
    ("remote_block_ids", [100.0, 101.0, 102.0, 103.0, 104.0]),
    ("remote_block_ids", [100, 101, 102, 103, True]),
    ("remote_block_ids", [100, 101, 102, 103, None]),
    ("remote_block_ids", [[100], 101, 102, 103, 104]),
    ("remote_block_ids", (100, 101, 102, 103, 104)),  # a tuple is not what JSON or msgpack give
    ("remote_block_ids", None),
    ("kvshuttle_digests", "0" * 159),  # odd length
    ("kvshuttle_digests", "00 " * 80),  # bytes.fromhex skips the spaces; the wire format has none
    ("kvshuttle_digests", "é" * 160),
    ("kvshuttle_digests", b"\x00" * 80),
    ("kvshuttle_digests", "00" * 16 * 4),  # four digests for five blocks
    ("kvshuttle_digests", "00" * 16 * 6),
    ("kvshuttle_digest_size", 65),  # past blake2b's 64
    ("kvshuttle_digest_size", -16),
    ("kvshuttle_digest_size", 10**400),
    ("kvshuttle_digest_size", 16.0),
    ("remote_engine_id", ""),
    ("remote_request_id", ""),
    ("remote_host", ""),
    ("remote_host", None),
    ("remote_engine_id", 7),
    ("kvshuttle_handle_id", b"h-Zx81"),
], ids=lambda v: repr(v)[:30])
def test_every_malformed_field_is_a_handle_format_error(field: str, value: Any) -> None:
    params = handle().to_kv_transfer_params()
    params[field] = value
    with pytest.raises(HandleFormatError) as info:
        KVHandle.from_kv_transfer_params(params, None)
    assert type(info.value) is HandleFormatError and str(info.value)


def test_negative_tokens_with_no_blocks_are_refused() -> None:
    """0 == n blocks holds exactly 0 tokens, not -5 (the empty-list corner the old check let through)."""
    empty = KVHandle(**{**handle().__dict__, "block_ids": (), "digests": (), "num_tokens": 0})
    params = empty.to_kv_transfer_params()
    params["remote_num_tokens"] = -5
    with pytest.raises(HandleFormatError):
        KVHandle.from_kv_transfer_params(params, None)
    with pytest.raises(HandleFormatError, match="num_tokens"):
        KVHandle(**{**empty.__dict__, "num_tokens": -5}).check()


def test_uppercase_hex_and_large_valid_values_parse() -> None:
    params = handle().to_kv_transfer_params()
    params["kvshuttle_digests"] = params["kvshuttle_digests"].upper()
    params["kvshuttle_generation"] = 2**63 - 1
    params["remote_block_ids"] = [2**63 - 5, 2**63 - 4, 2**63 - 3, 2**63 - 2, 2**63 - 1]
    parsed = KVHandle.from_kv_transfer_params(params, None)
    assert parsed.digests == handle().digests and parsed.generation == 2**63 - 1


def _wrong_values() -> st.SearchStrategy[Any]:
    """What a confused or hostile peer could put in a field after JSON or msgpack decoding, and then some."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([2**63, -(2**63) - 1, 10**400]),
        st.floats(), st.text(max_size=8), st.binary(max_size=8),
        st.sampled_from(["00", "zz", "0" * 33, "00 " * 16, "", "NaN", "1e400"]),
    )
    return st.one_of(scalars, st.lists(scalars, max_size=6), st.dictionaries(st.text(max_size=3), scalars, max_size=2),
                     st.lists(st.floats(), min_size=1, max_size=5), st.lists(st.integers(-(2**65), 2**65), max_size=6))


FIELDS = tuple(handle().to_kv_transfer_params())


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), _wrong_values(), min_size=1, max_size=3),
       dropped=st.lists(st.sampled_from(FIELDS), max_size=2), blocks=st.integers(0, 6))
def test_mutated_params_raise_only_handle_format_error(changes: dict[str, Any], dropped: list[str],
                                                       blocks: int) -> None:
    """Any field (or several) set to a random wrong type or value, or missing: a HandleFormatError, or a handle
    that is valid and round-trips. Never another exception: the prefill recomputes on HandleFormatError only."""
    params = handle(blocks, max(blocks * 16 - 3, 0)).to_kv_transfer_params()
    params.update(changes)
    for name in dropped:
        params.pop(name, None)
    try:
        parsed = KVHandle.from_kv_transfer_params(params, None)
    except HandleFormatError as exc:
        assert type(exc) is HandleFormatError and str(exc)
        return
    parsed.check()
    assert KVHandle.from_kv_transfer_params(parsed.to_kv_transfer_params(), None) == parsed


# ---------------------------------------------------------------------------- authenticated handles (MAC)
SECRET = DeploymentSecret(b"kv-handle-tests-deployment-secret-000001")


def test_signed_handle_verifies_after_a_json_round_trip() -> None:
    original = handle()
    params = json.loads(json.dumps(original.to_kv_transfer_params(SECRET)))
    assert KVHandle.from_kv_transfer_params(params, SECRET) == original


@pytest.mark.parametrize(("field", "value"), [
    ("remote_host", "10.9.9.9"), ("remote_port", 5601), ("remote_engine_id", "decode-1"),
    ("remote_request_id", "req-2"), ("remote_block_ids", [100, 101, 102, 103, 199]), ("remote_num_tokens", 65),
    ("remote_blocks_expiry_time", 1_800_000_000.0), ("tp_size", 4), ("kvshuttle_handle_id", "h-other"),
    ("kvshuttle_generation", 8), ("kvshuttle_digests", "ab" * 80), ("kvshuttle_issued_at", 1.0),
    ("kvshuttle_ttl_s", 1e6), ("kvshuttle_cache_dtype", "fp8_e5m2"), ("kvshuttle_reads", "use_once"),
])
def test_every_edited_field_fails_the_mac(field: str, value: Any) -> None:
    params = handle().to_kv_transfer_params(SECRET)
    params[field] = value
    with pytest.raises(HandleAuthError, match="forged or edited"):
        KVHandle.from_kv_transfer_params(params, SECRET)
    assert KVHandle.from_kv_transfer_params(params, None).__dict__[_attr(field)] is not None  # still well formed


def _attr(field: str) -> str:
    names = {"remote_host": "host", "remote_port": "port", "remote_engine_id": "engine_id",
             "remote_request_id": "request_id", "remote_block_ids": "block_ids", "remote_num_tokens": "num_tokens",
             "remote_blocks_expiry_time": "expiry_time", "tp_size": "tp_size", "kvshuttle_reads": "read_mode"}
    return names.get(field, field.removeprefix("kvshuttle_"))


@pytest.mark.parametrize("mac", [None, "", "00" * 16, "zz" * 16, 7, "ab" * 17])
def test_missing_or_wrong_mac_is_refused(mac: Any) -> None:
    params = handle().to_kv_transfer_params(SECRET)
    if mac is None:
        del params["kvshuttle_mac"]
    else:
        params["kvshuttle_mac"] = mac
    with pytest.raises(HandleAuthError):
        KVHandle.from_kv_transfer_params(params, SECRET)


def test_a_handle_of_another_deployment_is_refused() -> None:
    other = DeploymentSecret(b"another-deployment-secret-entirely-000002")
    with pytest.raises(HandleAuthError, match="another deployment secret"):
        KVHandle.from_kv_transfer_params(handle().to_kv_transfer_params(other), SECRET)


def test_a_local_secret_trusts_loopback_owners_only(tmp_path: Any) -> None:
    local = DeploymentSecret.local(tmp_path)
    assert local.scope == "local"
    remote = KVHandle(**{**handle().__dict__, "host": "10.0.0.7"})
    with pytest.raises(HandleAuthError, match="loopback"):
        KVHandle.from_kv_transfer_params(remote.to_kv_transfer_params(local), local)
    assert KVHandle.from_kv_transfer_params(handle().to_kv_transfer_params(local), local) == handle()


def test_parse_handle_names_the_refusal() -> None:
    params = {**handle().to_kv_transfer_params(SECRET), "remote_host": "203.0.113.5"}
    decision = parse_handle(params, secret=SECRET)
    assert not isinstance(decision, KVHandle)
    assert decision.reason is Reason.UNAUTHENTICATED_HANDLE and "forged or edited" in decision.message


# ------------------------------------------------------------------------- the MAC input is injective
_TEXT = st.text(alphabet=st.sampled_from("a0.:,\0\x01-"), min_size=1, max_size=6)  # separators included


@st.composite
def _handles(draw: st.DrawFn) -> KVHandle:
    blocks = draw(st.integers(0, 3))
    size = draw(st.sampled_from([1, 2, 16]))
    block_size = draw(st.sampled_from([1, 2, 16]))
    tokens = 0 if blocks == 0 else draw(st.integers((blocks - 1) * block_size + 1, blocks * block_size))
    ids = draw(st.lists(st.integers(0, 300), min_size=blocks, max_size=blocks, unique=True))
    digests = draw(st.lists(st.binary(min_size=size, max_size=size), min_size=blocks, max_size=blocks))
    host = draw(_TEXT.filter(lambda h: ":" not in h and "," not in h and "\0" not in h))
    port = draw(st.integers(1, 3))
    tp = draw(st.integers(1, 2))
    ranks = (f"{host}:{port}", *(f"r{k}:{port}" for k in range(1, tp))) if draw(st.booleans()) else ()
    when = st.sampled_from([0.0, 1.5, 2.0, 1e9])
    return KVHandle(draw(_TEXT), draw(_TEXT), host, port, tuple(ids), tokens, draw(when), tp, draw(_TEXT),
                    draw(st.integers(0, 3)), block_size, tuple(digests), draw(when), draw(when), ranks,
                    draw(st.sampled_from(["", "bfloat16", "fp8_e4m3"])), draw(st.sampled_from(["multi_read",
                                                                                               "use_once"])))


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(_handles(), _handles(), st.data())
def test_different_handles_never_share_signing_bytes(a: KVHandle, other: KVHandle, data: st.DataObject) -> None:
    """A MAC over one handle never verifies another: no two field sets share a MAC input. Besides an unrelated
    handle, each example tries the neighbours an encoding with separators would confuse: the text of two
    adjacent string fields cut at another separator byte."""
    assert a.structure_problem() is None and other.structure_problem() is None
    neighbours = [other]
    for first, second in (("engine_id", "request_id"), ("request_id", "host"), ("handle_id", "engine_id")):
        joined = getattr(a, first) + "\0" + getattr(a, second)
        cuts = [k for k, c in enumerate(joined) if c == "\0" and 0 < k < len(joined) - 1]
        cut = data.draw(st.sampled_from(cuts))
        moved = KVHandle(**{**a.__dict__, first: joined[:cut], second: joined[cut + 1:]})
        if moved.structure_problem() is None:
            neighbours.append(moved)
    for b in neighbours:
        if a != b:
            assert a.signing_bytes() != b.signing_bytes(), (a, b)


def test_a_separator_moved_between_fields_changes_the_mac() -> None:
    """The case a NUL-joined encoding let through: ``engine_id="x\\0y", request_id="z"`` and ``engine_id="x",
    request_id="y\\0z"`` joined to the same bytes."""
    one = KVHandle(**{**handle().__dict__, "engine_id": "x\0y", "request_id": "z"})
    two = KVHandle(**{**handle().__dict__, "engine_id": "x", "request_id": "y\0z"})
    assert one.signing_bytes() != two.signing_bytes() and one.mac(SECRET) != two.mac(SECRET)
    with pytest.raises(HandleAuthError):
        KVHandle.from_kv_transfer_params({**two.to_kv_transfer_params(), "kvshuttle_mac": one.mac(SECRET)}, SECRET)
