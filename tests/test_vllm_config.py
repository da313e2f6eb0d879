"""The connector's settings: vLLM's key names, ours, and a named error for every value it cannot use.

Runs without vLLM (the config module does not import it)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from kvshuttle.integrations.vllm import ConnectorConfigError, ShuttleConfig


def test_defaults_follow_vllm() -> None:
    config = ShuttleConfig.from_extra({}, model="m")
    assert (config.bidirectional, config.threshold_tokens, config.decode_ttl_s) == (False, 64, 480.0)
    assert config.backends == ("UCX",) and config.reads == "multi_read" and config.path == "auto"
    policy = config.policy()
    assert policy.kind == "fixed" and policy.threshold_tokens == 64 and policy.extra_key == b"m"


def test_vllm_keys_and_ours() -> None:
    config = ShuttleConfig.from_extra({
        "bidirectional_kv_xfer": True, "kv_recompute_threshold": 0, "decoder_kv_blocks_ttl": 60,
        "kv_lease_duration": 5, "backends": ["LIBFABRIC"], "num_threads": 0, "kvshuttle_reads": "use_once",
        "kvshuttle_retention_budget_blocks": 100, "kvshuttle_path": "packed", "kvshuttle_port": 5600,
        "kvshuttle_load_timeout_s": 2.5, "kvshuttle_digest_key": "qwen3-32b"})
    assert config.bidirectional and config.decode_ttl_s == 60.0 and config.prefill_ttl_s == 5.0
    assert config.backends == ("LIBFABRIC",) and config.reads == "use_once" and config.budget_blocks == 100
    assert config.policy().threshold_tokens == 1  # vLLM's "<= 0: always read"
    assert config.policy().extra_key == b"qwen3-32b"


def test_cost_model() -> None:
    config = ShuttleConfig.from_extra({"kvshuttle_cost_model": {
        "kv_bytes_per_token": 32768, "bandwidth_bytes_per_s": 3e9, "prefill_tokens_per_s": 500}})
    assert config.policy().kind == "cost"


@pytest.mark.parametrize("extra, key", [
    ({"bidirectional_kv_xfer": "yes"}, "bidirectional_kv_xfer"),
    ({"kv_recompute_threshold": 6.5}, "kv_recompute_threshold"),
    ({"decoder_kv_blocks_ttl": 0}, "decoder_kv_blocks_ttl"),
    ({"decoder_kv_blocks_ttl": "forever"}, "decoder_kv_blocks_ttl"),
    ({"kv_lease_duration": float("nan")}, "kv_lease_duration"),
    ({"backends": []}, "backends"),
    ({"kvshuttle_reads": "twice"}, "kvshuttle_reads"),
    ({"kvshuttle_retention_budget_blocks": 0}, "kvshuttle_retention_budget_blocks"),
    ({"kvshuttle_path": "fast"}, "kvshuttle_path"),
    ({"kvshuttle_port": 70000}, "kvshuttle_port"),
    ({"kvshuttle_load_timeout_s": -1}, "kvshuttle_load_timeout_s"),
    ({"kvshuttle_cost_model": {"kv_bytes_per_token": 1}}, "kvshuttle_cost_model"),
    ({"kvshuttle_cost_model": "fast"}, "kvshuttle_cost_model"),
    ({"kvshuttle_typo": 1}, "kvshuttle_typo"),
])
def test_bad_values_are_named_errors(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConnectorConfigError, match=key):
        ShuttleConfig.from_extra(extra)


def test_config_imports_without_vllm() -> None:
    if "vllm" in sys.modules:
        pytest.skip("vllm already imported in this process")
    import kvshuttle.integrations.vllm.config  # noqa: F401

    assert "vllm" not in sys.modules
