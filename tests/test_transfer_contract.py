"""The transfer engine's error contract: every public entry point, fed wrong types and out-of-range values,
raises only named kvshuttle errors, before anything is posted, and writes nothing into the local cache.

One real owner process serves the blocks; the reader's cache is poisoned and compared byte for byte after
each bad call. Hypothesis draws the bad argument and the call it goes to.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl._api")

from conftest import POISON, Geo, make_cache
from kvshuttle import KVShuttleError
from kvshuttle.transfer import (
    EngineConfig,
    Peer,
    PeerLostError,
    TransferArgumentError,
    TransferEngine,
)
from transfer_helpers import OwnerProcess, OwnerSpec

GEO = Geo(kind="flash_attn", order="NHD", dtype="float16", num_layers=2, num_blocks=16, block_size=16,
          num_heads=4, head_size=32)
STAGING = {"staging_chunk_bytes": 32 << 10, "staging_chunks": 4}

WRONG = [None, "4", b"4", 4.5, math.nan, math.inf, -1, -(2**70), 2**70, True, [1, [2]], {"a": 1}, object(),
         np.float32(2.0), np.array([[1, 2]]), np.array([0.5, 1.5]), ["a", "b"]]
VALID = {"local_ids": [0, 1], "remote_ids": [2, 3], "num_tokens": 32, "path": "auto", "notify": b"",
         "timeout": 5.0, "num_heads": None, "local_head_offset": 0, "remote_head_offset": 0}


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    with OwnerProcess([OwnerSpec(GEO, 31, STAGING)]) as proc:
        yield proc


@pytest.fixture(scope="module")
def reader(owner: OwnerProcess) -> Iterator[tuple[TransferEngine, Any, Peer]]:
    cache = make_cache(np.random.default_rng(3), GEO)
    for raw in cache.raws:
        raw[:] = POISON
    engine = TransferEngine(cache.cache(), EngineConfig(**STAGING))
    try:
        yield engine, cache, engine.connect(owner.addresses[0])
    finally:
        engine.close()


def untouched(cache: Any) -> bool:
    return all(bool((raw == POISON).all()) for raw in cache.raws)


# Values from WRONG that are right for one argument: the defaults, a 4.5 s or ~10**21 s timeout, a notify payload.
VALID_ANYWAY = {("num_tokens", "None"), ("num_heads", "None"), ("timeout", "None"), ("timeout", "4.5"),
                ("timeout", str(2**70)), ("notify", str(b"4"))}


LAYERED = {"local_ids": [0, 1], "remote_ids": [2, 3], "groups": 2, "notify": b"", "timeout": 5.0}
LAYERED_ANYWAY = {("groups", "None"), ("timeout", "None"), ("timeout", "4.5"), ("timeout", str(2**70)),
                  ("notify", str(b"4"))}
ENTRIES = {"read": (VALID, VALID_ANYWAY), "read_layers": (LAYERED, LAYERED_ANYWAY)}


@settings(max_examples=230, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=st.sampled_from(sorted(ENTRIES)), data=st.data())
def test_reads_reject_bad_arguments_with_named_errors(reader: tuple[TransferEngine, Any, Peer], call: str,
                                                      data: st.DataObject) -> None:
    engine, cache, peer = reader
    valid, anyway = ENTRIES[call]
    argument, value = data.draw(st.sampled_from(sorted(valid))), data.draw(st.sampled_from(WRONG))
    if (argument, str(value)) in anyway:  # defaults, and a timeout of 10**21 s (just very patient)
        return
    kwargs = {**valid, argument: value}
    handle = None
    with contextlib.suppress(KVShuttleError):
        handle = getattr(engine, call)(peer, kwargs.pop("local_ids"), kwargs.pop("remote_ids"), **kwargs)
    if handle is not None:
        handle.release()
        pytest.fail(f"{call} accepted {argument}={value!r}")
    assert untouched(cache)
    assert engine.stats()["active_transfers"] == 0


@pytest.mark.parametrize("argument, value", [
    ("num_tokens", 40.5), ("num_tokens", "32"), ("num_tokens", True), ("num_heads", 2.0), ("num_heads", "2"),
    ("num_heads", 0), ("path", "fast"), ("timeout", -1.0), ("notify", "text"), ("local_head_offset", 1.5),
])
def test_the_issue_examples_are_transfer_argument_errors(reader: tuple[TransferEngine, Any, Peer], argument: str,
                                                        value: Any) -> None:
    engine, cache, peer = reader
    kwargs = {**VALID, argument: value}
    with pytest.raises(TransferArgumentError, match=argument.split("_")[-1] if argument != "notify" else "notify"):
        engine.read(peer, kwargs.pop("local_ids"), kwargs.pop("remote_ids"), **kwargs)
    assert untouched(cache)


@pytest.mark.parametrize("address", ["127.0.0.1:5555", "tcp://", "tcp://host", "tcp://h:0", "tcp://h:99999",
                                     "tcp://h:port", "", None, 5555, b"tcp://127.0.0.1:1"])
def test_connect_rejects_malformed_addresses(reader: tuple[TransferEngine, Any, Peer], address: Any) -> None:
    engine, _, _ = reader
    with pytest.raises(TransferArgumentError, match="tcp://host:port"):
        engine.connect(address)


@pytest.mark.parametrize("peer", [None, "tcp://127.0.0.1:1", object()])
def test_calls_with_a_non_peer_are_named_errors(reader: tuple[TransferEngine, Any, Peer], peer: Any) -> None:
    engine, cache, _ = reader
    with pytest.raises(PeerLostError, match="connect"):
        engine.read(peer, [0], [0])
    with pytest.raises(PeerLostError):
        engine.finish_claim(peer, None, ok=True)  # type: ignore[arg-type]
    assert engine.ping(peer) is False
    engine.disconnect(peer)  # a no-op, not a crash
    assert untouched(cache)


@pytest.mark.parametrize("handle, num_blocks", [(None, None), ({"remote_block_ids": [1]}, None), ("h", 1)])
def test_claim_rejects_what_is_not_a_handle(reader: tuple[TransferEngine, Any, Peer], handle: Any,
                                            num_blocks: Any) -> None:
    engine, _, peer = reader
    with pytest.raises(TransferArgumentError, match="KVHandle"):
        engine.claim(peer, handle, num_blocks)


@pytest.mark.parametrize("change", [{"port": -1}, {"port": 70000}, {"connect_timeout_s": 0}, {"peer_timeout_s": "1"},
                                    {"staging_chunks": 1.5}, {"staging_chunk_bytes": 0}, {"backends": "UCX"},
                                    {"direct_mode": "fast"}, {"transfer_timeout_s": math.nan}])
def test_engine_config_is_checked(change: dict[str, Any]) -> None:
    with pytest.raises(TransferArgumentError, match="EngineConfig"):
        EngineConfig(**change)


@pytest.mark.parametrize("cache, config", [(None, None), ("cache", None), (np.zeros(4), None)])
def test_engine_needs_a_paged_cache(cache: Any, config: Any) -> None:
    with pytest.raises(TransferArgumentError, match="PagedKVCache"):
        TransferEngine(cache, config)
