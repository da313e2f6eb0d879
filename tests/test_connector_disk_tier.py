"""The connector's disk tier (issue 35 item 2), without vLLM: the ``kvshuttle_disk_tier_*`` keys, the handles naming
the whole life (hot, host, disk TTLs), and real ShuttleWorkers over a small vLLM CPU cache: a retention past its
hot TTL and then its host TTL lands in a file, a reader worker reads it back byte for byte, the stats carry
``tier.disk.*``, and shutdown leaves nothing in the operator's directory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvshuttle.integrations.vllm import ShuttleConfig
from kvshuttle.integrations.vllm.config import ConnectorConfigError
from kvshuttle.policy import Decision, KVHandle
from kvshuttle.policy.decision import Reason
from kvshuttle.retention import TierTerms
from test_connector_host_tier import DIGESTS, demoted, until, workers  # noqa: F401 (fixture)
from test_connector_tp import H0, finish, tp_scheduler
from test_vllm_scheduler import BS

pytestmark = pytest.mark.timeout(120)

HOT_TTL_S = HOST_TTL_S = 0.3
MIB = 2**20


def disk_extra(root: Path, **more: Any) -> dict[str, Any]:
    return {"decoder_kv_blocks_ttl": HOT_TTL_S, "kvshuttle_host_tier_blocks": 8,
            "kvshuttle_host_tier_ttl_s": HOST_TTL_S, "kvshuttle_disk_tier_dir": str(root),
            "kvshuttle_disk_tier_bytes": MIB, **more}


def test_disk_tier_keys_make_the_terms_disk_tier(tmp_path: Path) -> None:
    config = ShuttleConfig.from_extra(disk_extra(tmp_path, kvshuttle_disk_tier_ttl_s=7200,
                                                 kvshuttle_disk_tier_bytes=str(4 * MIB)), model="m")
    assert config.terms().disk == TierTerms(ttl_s=7200.0, name="disk", capacity_bytes=4 * MIB)
    assert ShuttleConfig.from_extra({}).terms().disk is None
    assert ShuttleConfig.from_extra(disk_extra(tmp_path)).terms().disk == TierTerms(ttl_s=4 * 3600.0, name="disk",
                                                                                   capacity_bytes=MIB)
    for extra, key in (({"kvshuttle_disk_tier_bytes": -1}, "kvshuttle_disk_tier_bytes"),
                       ({"kvshuttle_disk_tier_ttl_s": 0}, "kvshuttle_disk_tier_ttl_s"),
                       ({"kvshuttle_disk_tier_eviction": "fifo"}, "kvshuttle_disk_tier_eviction"),
                       ({"kvshuttle_disk_tier_dir": ""}, "kvshuttle_disk_tier_dir"),
                       ({"kvshuttle_disk_tier_dir": None}, "set all three"),
                       ({"kvshuttle_disk_tier_bytes": 0}, "set all three"),
                       ({"kvshuttle_host_tier_blocks": 0}, "set all three")):
        with pytest.raises(ConnectorConfigError, match=key):
            ShuttleConfig.from_extra({**disk_extra(tmp_path), **extra})


def test_handles_name_the_hot_host_and_disk_ttls(tmp_path: Path) -> None:
    s = tp_scheduler(tp_size=1, **disk_extra(tmp_path, decoder_kv_blocks_ttl=5, kvshuttle_host_tier_ttl_s=100,
                                             kvshuttle_disk_tier_ttl_s=1000))
    s.set_ranks({0: H0})
    keep, params = finish(s, "d1")
    assert keep and params is not None and params["kvshuttle_ttl_s"] == 1105.0


def test_a_retention_past_its_hot_and_host_ttls_is_read_back_from_its_file(
        workers: Any, tmp_path: Path) -> None:  # noqa: F811
    w, owner = workers("owner", 11, **disk_extra(tmp_path))
    r, mine = workers("reader", 12)
    assert w.ledger is not None and w.disk is not None and w.engine is not None and r.reader is not None
    assert w.engine.disk is w.disk and w.disk.dir.parent == tmp_path
    blocks = [3, 4]
    original = [owner.canonical(layer)[:, blocks].copy() for layer in range(owner.geo.num_layers)]
    demoted(w)  # hot -> host: vLLM frees (and here scribbles) the blocks
    for layer in range(owner.geo.num_layers):
        owner.canonical(layer)[:, blocks] = 0x11
    disk = until(lambda: (w.finished(set()), w.ledger.metrics()["tiers"]["disk"])[1], lambda d: d["demotions"] == 1)
    assert disk["blocks"] == 2 and w.ledger.metrics()["tiers"]["host"]["blocks"] == 0
    assert [p.suffix for p in w.disk.dir.iterdir() if p.name != ".lock"] == [".kv"]
    handle = KVHandle("owner", "req-a", w.ledger.host, w.ledger.port, (3, 4), 64, time.time() + 60, 1, "h-a", 0,
                      BS, DIGESTS, time.time(), 60.0)
    decision = Decision("fetch", Reason.FETCH, "test", fetch_tokens=64, reused_tokens=64, fetch_blocks=range(2),
                        remote_block_ids=(3, 4), block_size=BS)
    result = r.reader.fetch(decision, handle, np.array([10, 11]), 64, deadline=time.monotonic() + 10)
    assert result.action == "fetched", result
    for layer in range(owner.geo.num_layers):
        assert np.array_equal(mine.canonical(layer)[:, [10, 11]], original[layer])
    stats = w.take_stats().data
    assert (stats["tier.disk.blocks"], stats["tier.disk.demotions"], stats["tier.disk.reads"]) == (2, 1, 1)
    assert stats["tier.disk.bytes"] == 2 * w.disk.block_bytes and stats["tier.host.blocks"] == 0
    assert w.ledger.release("h-a") and w.state_sizes()["tiered"] == 0
    w.shutdown()
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_unusable_disk_tier_directory_refuses_to_start(workers: Any, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(ConnectorConfigError, match="kvshuttle_disk_tier_dir"):
        workers("owner", 13, **disk_extra(tmp_path / "missing"))


def test_a_disk_tier_on_a_gpu_cache_refuses_to_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A GPU engine serves a host tier (its slots pinned and mapped) but not a disk tier: a file read back into host
    memory would be packed on the host into staging that is VRAM there."""
    from kvshuttle.core.layout import PagedKVCache
    from test_connector_host_tier import worker

    monkeypatch.setattr(PagedKVCache, "is_cuda", property(lambda self: True))
    with pytest.raises(ConnectorConfigError, match="kvshuttle_disk_tier_dir"):
        worker("gpu", 7, **disk_extra(tmp_path))
