"""A handle the ledger issues again (a renewal, a look-up) names what the first one did: the cache dtype its
bytes hold and the read mode of the retention, so a reader never meets a renewed handle it must refuse."""

from __future__ import annotations

import pytest

from kvshuttle.retention import RetentionLedger


@pytest.mark.parametrize("mode", ["multi_read", "use_once"])
def test_a_renewed_handle_names_the_cache_dtype_and_read_mode(mode: str) -> None:
    ledger = RetentionLedger("decode-0", "127.0.0.1", 5600, ttl_s=60.0)
    ledger.cache_dtype = "fp8_e4m3"
    issued = ledger.retain("r1", [4, 5], [b"\x01" * 16, b"\x02" * 16], 32, 16, mode=mode)  # type: ignore[arg-type]
    renewed = ledger.renew(issued.handle_id, ttl_s=120.0)
    looked_up = ledger.get(issued.handle_id)
    for handle in (issued, renewed, looked_up):
        assert handle is not None
        assert (handle.cache_dtype, handle.read_mode) == ("fp8_e4m3", mode)
