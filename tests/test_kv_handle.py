"""The handle's kv_transfer_params wire format: round trip, vLLM field names, strict parsing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvshuttle.policy import HandleFormatError, KVHandle


def handle(blocks: int = 5, tokens: int = 70) -> KVHandle:
    return KVHandle(engine_id="decode-0", request_id="req-1", host="127.0.0.1", port=5600,
                    block_ids=tuple(range(100, 100 + blocks)), num_tokens=tokens, expiry_time=1_700_000_480.5,
                    tp_size=2, handle_id="h-Zx81", generation=7, block_size=16,
                    digests=tuple(bytes([k]) * 16 for k in range(blocks)), issued_at=1_700_000_000.5, ttl_s=480.0)


def test_round_trip_through_json() -> None:
    original = handle()
    params = json.loads(json.dumps(original.to_kv_transfer_params()))
    assert KVHandle.from_kv_transfer_params(params) == original


def test_vllm_field_names_carry_the_same_meaning() -> None:
    params = handle().to_kv_transfer_params()
    assert params["remote_block_ids"] == list(range(100, 105))
    assert (params["remote_engine_id"], params["remote_request_id"]) == ("decode-0", "req-1")
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("127.0.0.1", 5600, 2)
    assert params["remote_num_tokens"] == 70 and params["remote_blocks_expiry_time"] == 1_700_000_480.5
    assert all(k.startswith(("remote_", "tp_size", "kvshuttle_")) for k in params)


def test_empty_handle_round_trips() -> None:
    empty = KVHandle(**{**handle().__dict__, "block_ids": (), "digests": (), "num_tokens": 0})
    assert KVHandle.from_kv_transfer_params(empty.to_kv_transfer_params()) == empty


@pytest.mark.parametrize(("field", "value"), [
    ("remote_port", True),  # a bool is not a port
    ("remote_port", 70000),
    ("remote_block_ids", [100, 101, 101, 103, 104]),
    ("remote_block_ids", [100, -1, 102, 103, 104]),
    ("remote_block_ids", "100,101"),
    ("remote_num_tokens", 90),  # more than 5 blocks of 16 hold
    ("remote_num_tokens", 64),  # the last block would be empty
    ("remote_blocks_expiry_time", float("nan")),
    ("kvshuttle_version", 2),
    ("kvshuttle_generation", -1),
    ("kvshuttle_digests", "xyz"),
    ("kvshuttle_digest_size", 15),
    ("kvshuttle_handle_id", ""),
    ("kvshuttle_block_size", 0),
])
def test_malformed_params_are_named_errors(field: str, value: Any) -> None:
    params = handle().to_kv_transfer_params()
    params[field] = value
    with pytest.raises(HandleFormatError):
        KVHandle.from_kv_transfer_params(params)


@pytest.mark.parametrize("missing", ["remote_block_ids", "remote_engine_id", "kvshuttle_digests", "kvshuttle_version"])
def test_missing_fields_are_named_errors(missing: str) -> None:
    params = handle().to_kv_transfer_params()
    del params[missing]
    with pytest.raises(HandleFormatError, match=missing):
        KVHandle.from_kv_transfer_params(params)


def test_not_a_dict() -> None:
    with pytest.raises(HandleFormatError):
        KVHandle.from_kv_transfer_params(["remote_block_ids"])
