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


def test_trust_and_capacity_defaults() -> None:
    """Retention needs a router's grant, lasts at most an hour, takes at most a quarter of the engine's KV blocks;
    four loads run at once; handles name the bind address."""
    config = ShuttleConfig.from_extra({}, model="m")
    assert (config.retain, config.max_ttl_s, config.max_concurrent_loads) == ("granted", 3600.0, 4)
    assert config.budget_blocks is None and config.budget_fraction == 0.25
    assert config.retention_budget(1000) == 250 and config.retention_budget(3) == 1  # never 0 blocks
    assert (config.host, config.advertise_host) == ("127.0.0.1", None)


def test_trust_and_capacity_keys() -> None:
    config = ShuttleConfig.from_extra({
        "kvshuttle_retain": "always", "kvshuttle_max_ttl_s": 600, "kvshuttle_retention_budget_fraction": 0.5,
        "kvshuttle_host": "0.0.0.0", "kvshuttle_advertise_host": "10.0.0.7", "kvshuttle_max_concurrent_loads": "8"})
    assert (config.retain, config.max_ttl_s, config.max_concurrent_loads) == ("always", 600.0, 8)
    assert config.retention_budget(1000) == 500
    assert (config.host, config.advertise_host) == ("0.0.0.0", "10.0.0.7")
    assert ShuttleConfig.from_extra({"kvshuttle_retention_budget_blocks": 7}).retention_budget(1000) == 7


def test_retention_terms_come_from_one_place() -> None:
    """The connector's retention defaults are the terms' own, and its keys make up the decode's terms."""
    from kvshuttle.retention import RetentionTerms

    defaults = ShuttleConfig.from_extra({}, model="m")
    assert defaults.terms() == RetentionTerms() and ShuttleConfig().terms() == RetentionTerms()
    config = ShuttleConfig.from_extra({"decoder_kv_blocks_ttl": 60, "kvshuttle_max_ttl_s": 600,
                                       "kvshuttle_reads": "use_once", "kvshuttle_retention_budget_blocks": 9,
                                       "kvshuttle_retain": "always"})
    assert config.terms() == RetentionTerms(ttl_s=60.0, max_ttl_s=600.0, read_mode="use_once", budget_blocks=9,
                                            retain="always")
    with pytest.raises(ConnectorConfigError, match="kvshuttle_reads"):
        ShuttleConfig.from_extra({"kvshuttle_reads": "multi"})  # the router's old word is not the connector's


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
    ({"kvshuttle_retention_budget_fraction": 0}, "kvshuttle_retention_budget_fraction"),
    ({"kvshuttle_retention_budget_fraction": 1.5}, "kvshuttle_retention_budget_fraction"),
    ({"kvshuttle_retention_budget_fraction": "most"}, "kvshuttle_retention_budget_fraction"),
    ({"kvshuttle_retention_budget_fraction": True}, "kvshuttle_retention_budget_fraction"),
    ({"kvshuttle_retention_budget_fraction": 0.5, "kvshuttle_retention_budget_blocks": 10},
     "kvshuttle_retention_budget_fraction"),
    ({"kvshuttle_retain": "sometimes"}, "kvshuttle_retain"),
    ({"kvshuttle_retain": True}, "kvshuttle_retain"),
    ({"kvshuttle_max_ttl_s": 0}, "kvshuttle_max_ttl_s"),
    ({"kvshuttle_max_ttl_s": float("inf")}, "kvshuttle_max_ttl_s"),
    ({"kvshuttle_max_ttl_s": 10**400}, "kvshuttle_max_ttl_s"),  # too large for a float
    ({"kvshuttle_retention_budget_fraction": 10**400}, "kvshuttle_retention_budget_fraction"),
    ({"kvshuttle_max_ttl_s": 60}, "kvshuttle_max_ttl_s"),  # below decoder_kv_blocks_ttl's 480
    ({"decoder_kv_blocks_ttl": 7200}, "kvshuttle_max_ttl_s"),
    ({"kvshuttle_advertise_host": ""}, "kvshuttle_advertise_host"),
    ({"kvshuttle_advertise_host": 10}, "kvshuttle_advertise_host"),
    ({"kvshuttle_advertise_host": "0.0.0.0"}, "kvshuttle_advertise_host"),
    ({"kvshuttle_advertise_host": "a b"}, "kvshuttle_advertise_host"),
    ({"kvshuttle_host": "0.0.0.0"}, "kvshuttle_advertise_host"),  # a wildcard bind needs an address to advertise
    ({"kvshuttle_host": "host name"}, "kvshuttle_host"),
    ({"kvshuttle_host": 7}, "kvshuttle_host"),
    ({"kvshuttle_max_concurrent_loads": 0}, "kvshuttle_max_concurrent_loads"),
    ({"kvshuttle_max_concurrent_loads": 2.5}, "kvshuttle_max_concurrent_loads"),
    ({"kvshuttle_max_concurrent_loads": 1000}, "kvshuttle_max_concurrent_loads"),
    ({"kvshuttle_secret_file": ""}, "kvshuttle_secret_file"),
    ({"kvshuttle_secret_file": 3}, "kvshuttle_secret_file"),
    ({"kvshuttle_allowed_owners": "10.0.0.1"}, "kvshuttle_allowed_owners"),
    ({"kvshuttle_allowed_owners": []}, "kvshuttle_allowed_owners"),
])
def test_bad_values_are_named_errors(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConnectorConfigError, match=key):
        ShuttleConfig.from_extra(extra)


def test_config_imports_without_vllm() -> None:
    if "vllm" in sys.modules:
        pytest.skip("vllm already imported in this process")
    import kvshuttle.integrations.vllm.config  # noqa: F401

    assert "vllm" not in sys.modules


def test_secret_file_and_allowed_owners(tmp_path: Any) -> None:
    path = tmp_path / "secret"
    path.write_text("f" * 64)
    config = ShuttleConfig.from_extra({"kvshuttle_secret_file": str(path), "kvshuttle_allowed_owners": ["10.0.0.2"]})
    assert config.allowed_owners == ("10.0.0.2",)
    secret = config.deployment_secret()
    assert secret.scope == "deployment" and str(path) in secret.source
    from kvshuttle.trust import TrustError

    with pytest.raises(TrustError, match="cannot read"):
        ShuttleConfig.from_extra({"kvshuttle_secret_file": str(tmp_path / "missing")}).deployment_secret()
