"""The deployment secret, its keys and retention grants (kvshuttle.trust)."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.trust import DeploymentSecret, TrustError, grant_valid, is_loopback, issue_grant

TEXT = "0123456789abcdef0123456789abcdef-deployment"


def test_secret_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert DeploymentSecret.from_environment({}) is None
    from_env = DeploymentSecret.from_environment({"KVSHUTTLE_SECRET": TEXT})
    path = tmp_path / "secret"
    path.write_text(TEXT + "\n")
    from_file = DeploymentSecret.from_environment({"KVSHUTTLE_SECRET_FILE": str(path)})
    assert from_env is not None and from_file is not None
    assert from_env.fingerprint == from_file.fingerprint  # the same secret, whichever way it came
    assert from_env.scope == "deployment" and "file" in from_file.source


@pytest.mark.parametrize(("env", "match"), [
    ({"KVSHUTTLE_SECRET": "short"}, "at least 32"),
    ({"KVSHUTTLE_SECRET": TEXT, "KVSHUTTLE_SECRET_FILE": "/x"}, "not both"),
    ({"KVSHUTTLE_SECRET_FILE": "/nonexistent/kvshuttle-secret"}, "cannot read"),
])
def test_bad_secret_configuration_is_a_named_error(env: dict[str, str], match: str) -> None:
    with pytest.raises(TrustError, match=match):
        DeploymentSecret.from_environment(env)


def test_repr_and_errors_never_show_the_secret() -> None:
    secret = DeploymentSecret(TEXT.encode())
    assert TEXT not in repr(secret) and secret.fingerprint in repr(secret)
    with pytest.raises(TrustError) as info:
        DeploymentSecret(b"too-short-a-secret")
    assert "too-short" not in str(info.value)


def test_keys_are_independent_per_purpose_and_per_secret() -> None:
    a, b = DeploymentSecret(TEXT.encode()), DeploymentSecret((TEXT + "x").encode())
    assert a.key("kv-handle") != a.key("retention-grant") != a.key("curve")
    assert a.key("kv-handle") != b.key("kv-handle")
    tag = a.mac("kv-handle", b"data")
    assert a.verify("kv-handle", b"data", tag)
    assert not a.verify("retention-grant", b"data", tag)  # a MAC of one kind never passes for another
    assert not b.verify("kv-handle", b"data", tag)
    assert a.curve_keys() != b.curve_keys() and len(a.curve_keys()[0]) == 40


def _local(directory: str, out: Any) -> None:
    out.put(DeploymentSecret.local(directory).fingerprint)


def test_local_secret_is_private_and_shared_by_every_local_process(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_local, args=(str(tmp_path), out)) for _ in range(3)]
    for p in procs:
        p.start()
    fingerprints = {out.get(timeout=30) for _ in procs}
    for p in procs:
        p.join(30)
    assert len(fingerprints) == 1  # they raced to create it and all agree
    mode = stat.S_IMODE(os.stat(tmp_path / "local-secret").st_mode)
    assert mode == 0o600
    local = DeploymentSecret.local(tmp_path)
    assert local.scope == "local" and local.fingerprint in fingerprints


def test_a_local_secret_readable_by_others_is_refused(tmp_path: Path) -> None:
    DeploymentSecret.local(tmp_path)
    os.chmod(tmp_path / "local-secret", 0o644)
    with pytest.raises(TrustError, match="readable by other users"):
        DeploymentSecret.local(tmp_path)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("10.0.0.1", False), ("::", False), ("example.com", False), ("", False),
])
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_local_secret_binds_and_trusts_loopback_only(tmp_path: Path) -> None:
    local = DeploymentSecret.local(tmp_path)
    local.check_bind("127.0.0.1")
    with pytest.raises(TrustError, match="KVSHUTTLE_SECRET"):
        local.check_bind("0.0.0.0")
    assert not local.allows_host("10.1.1.1")
    deployment = DeploymentSecret(TEXT.encode())
    deployment.check_bind("0.0.0.0")
    assert deployment.allows_host("10.1.1.1")


def test_grants() -> None:
    secret = DeploymentSecret(TEXT.encode())
    grant = issue_grant(secret, ttl_s=60.0, now=1_000_000.0)
    assert grant_valid(secret, grant, now=1_000_030.0)
    assert not grant_valid(secret, grant, now=1_000_061.0)  # expired
    assert not grant_valid(DeploymentSecret((TEXT + "x").encode()), grant, now=1_000_030.0)
    version, expiry, tag = grant.split(".")
    assert not grant_valid(secret, f"{version}.{int(expiry) + 3600}.{tag}", now=1_000_030.0)  # extended: no
    for junk in (None, 7, "", "v1..", "v2." + grant[3:], grant + "00", "v1.x." + tag, "v1." + "9" * 40 + "." + tag):
        assert not grant_valid(secret, junk, now=1_000_030.0)
