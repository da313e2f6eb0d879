"""The deployment secret, its keys and retention grants (kvshuttle.trust)."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.trust import DeploymentSecret, GrantBook, TrustError, grant_valid, is_loopback, issue_grant

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
    version, expiry, nonce, tag = grant.split(".")
    assert not grant_valid(secret, f"{version}.{int(expiry) + 3600}.{nonce}.{tag}", now=1_000_030.0)  # extended
    other_nonce = ("0" if nonce[0] != "0" else "1") + nonce[1:]
    assert not grant_valid(secret, f"{version}.{expiry}.{other_nonce}.{tag}", now=1_000_030.0)  # a new nonce: no
    assert issue_grant(secret, ttl_s=60.0, now=1_000_000.0) != grant  # a fresh nonce each time
    for junk in (None, 7, "", "v1..", "v1." + grant[3:], grant + "00", "v2.x." + nonce + "." + tag,
                 "v2." + "9" * 40 + "." + nonce + "." + tag, f"v1.{expiry}.{tag}", "v2.1.2.3.4"):
        assert not grant_valid(secret, junk, now=1_000_030.0)


def test_a_grant_covers_a_request_that_arrived_in_time_however_long_its_answer() -> None:
    """Checked at admission (the request's arrival), not when the answer is done: a long reasoning answer that
    ends after the grant's expiry is still retained."""
    secret = DeploymentSecret(TEXT.encode())
    clock = [1_000_000.0]
    book = GrantBook(secret, clock=lambda: clock[0])
    grant = issue_grant(secret, ttl_s=60.0, now=clock[0])
    assert book.admit("long-answer", grant)
    clock[0] += 3600.0  # an hour of reasoning
    assert book.granted("long-answer", grant)
    assert book.admit("long-answer", grant)  # vLLM asks again after a preemption: the same answer
    book.finish("long-answer")
    assert not book.granted("late", issue_grant(secret, ttl_s=60.0, now=1_000_000.0))  # arrived after expiry


def test_a_grant_retains_one_request_only() -> None:
    """A grant replayed on other requests is refused there (the nonce is taken), whatever their order."""
    secret = DeploymentSecret(TEXT.encode())
    book = GrantBook(secret)
    grant = issue_grant(secret)
    assert book.admit("first", grant)
    assert not book.admit("replay-1", grant) and not book.granted("replay-2", grant)
    assert book.granted("first", grant) and book.refused["replayed"] == 2
    book.finish("first")
    assert not book.granted("replay-3", grant)  # the request ended; its nonce stays taken until the expiry
    assert book.granted("fresh", issue_grant(secret))


def test_a_grant_books_memory_is_bounded() -> None:
    """Nonces are forgotten once their grants expire (none can be admitted after that) and never exceed
    ``max_nonces``: beyond, grants are refused rather than remembered."""
    secret = DeploymentSecret(TEXT.encode())
    clock = [1_000_000.0]
    book = GrantBook(secret, max_nonces=100, clock=lambda: clock[0])
    grants = [issue_grant(secret, ttl_s=60.0, now=clock[0]) for _ in range(150)]
    admitted = [book.admit(f"r{i}", g) for i, g in enumerate(grants)]
    assert sum(admitted) == 100 and book.refused["full"] == 50 and book.sizes()["nonces"] == 100
    for i in range(150):
        book.finish(f"r{i}")
    clock[0] += 61.0
    assert book.admit("later", issue_grant(secret, ttl_s=60.0, now=clock[0]))
    assert book.sizes() == {"nonces": 1, "requests": 1}
    assert not book.admit("replayed-after-expiry", grants[0])  # expired: refused without its nonce
