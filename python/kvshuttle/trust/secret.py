"""The deployment secret: what makes a process a member of one kvshuttle deployment.

Every engine and router of a deployment shares one secret (``KVSHUTTLE_SECRET``, or a file named by
``KVSHUTTLE_SECRET_FILE``; never a command-line argument, which other users can read in ``ps``). From it come
independent keys (one per purpose, so a MAC of one kind can never pass for another):

* the side channel's CURVE key pair (ZMQ CurveZMQ: peers that do not hold the secret cannot complete the
  handshake, and the channel is encrypted, so the NIXL agent metadata it carries stays secret);
* the MAC key of handles (``kvshuttle_mac``: a handle is honoured only if a member issued it, unedited);
* the MAC key of retention grants (a router's permission for an engine to retain a request's blocks).

Without a configured secret kvshuttle still authenticates, with a *local* secret: a file only this user can
read (created on first use), so processes of one user on one host form a deployment of their own. A local
secret serves and trusts loopback addresses only: binding a routable address, or honouring a handle that
names one, needs the deployment secret.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from ..errors import KVShuttleError

SECRET_ENV = "KVSHUTTLE_SECRET"
SECRET_FILE_ENV = "KVSHUTTLE_SECRET_FILE"
MIN_SECRET_CHARS = 32  # e.g. `openssl rand -hex 32` prints 64
Scope = Literal["deployment", "local"]


class TrustError(KVShuttleError, ValueError):
    """The deployment secret is missing, unreadable or too weak for what was asked (a routable bind, a remote
    owner); the message says what to configure."""


@functools.lru_cache(maxsize=1024)  # asked for every handle the router checks; parsing the address is the cost
def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1); names are never resolved here."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class DeploymentSecret:
    """One deployment's secret and the keys derived from it; ``repr`` never shows it."""

    __slots__ = ("_keys", "_master", "fingerprint", "scope", "source")

    def __init__(self, secret: bytes, *, scope: Scope = "deployment", source: str = "explicit") -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_CHARS:
            raise TrustError(f"a deployment secret needs at least {MIN_SECRET_CHARS} characters (e.g. the output "
                             "of `openssl rand -hex 32`)")
        if scope not in ("deployment", "local"):
            raise TrustError(f"scope must be 'deployment' or 'local', got {scope!r}")
        self._master = hashlib.sha256(b"kvshuttle-secret-v1\0" + secret).digest()
        self._keys: dict[str, bytes] = {}
        self.scope: Scope = scope
        self.source = source
        # Safe to log: tells two processes' secrets apart without revealing either.
        self.fingerprint = self.key("fingerprint")[:6].hex()

    def __repr__(self) -> str:
        return f"DeploymentSecret(scope={self.scope!r}, source={self.source!r}, fingerprint={self.fingerprint})"

    # -- loading --------------------------------------------------------------------------------------------
    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> DeploymentSecret | None:
        """The secret configured in ``KVSHUTTLE_SECRET`` or the file ``KVSHUTTLE_SECRET_FILE`` names; None if
        neither is set. TrustError when both are set, the file is unreadable, or the secret is too short."""
        env = os.environ if environ is None else environ
        text, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
        if text and path:
            raise TrustError(f"set either {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
        if text:
            return cls(text.strip().encode(), source=SECRET_ENV)
        if path:
            return cls.from_file(path)
        return None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, scope: Scope = "deployment") -> DeploymentSecret:
        """The secret in a file (surrounding whitespace ignored)."""
        try:
            data = Path(path).read_bytes().strip()
        except OSError as exc:
            raise TrustError(f"cannot read the kvshuttle secret file {os.fspath(path)}: {exc.strerror}") from None
        return cls(data, scope=scope, source=f"file {os.fspath(path)}")

    @classmethod
    def local(cls, directory: str | os.PathLike[str] | None = None) -> DeploymentSecret:
        """This user's local secret (loopback only), created on first use with mode 0600."""
        base = Path(directory) if directory is not None else _local_dir()
        path = base / "local-secret"
        try:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another process may create it at the same moment
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_hex(32) + "\n")
            if path.stat().st_mode & 0o077:
                raise TrustError(f"{path} is readable by other users; remove it (kvshuttle recreates it, mode 0600)")
        except OSError as exc:
            raise TrustError(f"cannot create kvshuttle's local secret in {base}: {exc.strerror}; set "
                             f"{SECRET_ENV} or {SECRET_FILE_ENV}") from None
        for _ in range(50):  # the creator may not have written it yet
            secret = path.read_bytes().strip()
            if len(secret) >= MIN_SECRET_CHARS:
                return cls(secret, scope="local", source=f"local file {path}")
            time.sleep(0.01)
        raise TrustError(f"{path} holds no usable secret; remove it and retry")

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None) -> DeploymentSecret:
        """The configured deployment secret, else this user's local (loopback-only) secret."""
        return cls.from_environment(environ) or cls.local()

    # -- keys -----------------------------------------------------------------------------------------------
    def key(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose, independent of every other purpose's."""
        key = self._keys.get(purpose)
        if key is None:
            key = hashlib.blake2b(purpose.encode(), key=self._master, digest_size=32,
                                  person=b"kvshuttle-kdf").digest()
            self._keys[purpose] = key
        return key

    def mac(self, purpose: str, data: bytes) -> bytes:
        """HMAC-SHA256 of ``data`` under the purpose's key (16 bytes: 128-bit forgery resistance)."""
        return hmac.new(self.key(purpose), data, hashlib.sha256).digest()[:16]

    def verify(self, purpose: str, data: bytes, tag: bytes) -> bool:
        """True iff ``tag`` is ``mac(purpose, data)``; constant time."""
        return hmac.compare_digest(self.mac(purpose, data), tag)

    def curve_keys(self) -> tuple[bytes, bytes]:
        """The deployment's CURVE key pair (public, secret), Z85-encoded as ZMQ takes them."""
        import zmq
        from zmq.utils import z85

        secret_key = z85.encode(self.key("curve"))
        return zmq.curve_public(secret_key), secret_key

    # -- scope ----------------------------------------------------------------------------------------------
    def allows_host(self, host: str) -> bool:
        """Whether this secret may serve on, or trust an owner at, ``host`` (a local secret: loopback only)."""
        return self.scope == "deployment" or is_loopback(host)

    def check_bind(self, host: str, what: str = "the kvshuttle side channel") -> None:
        """TrustError when ``host`` is not loopback and only a local secret is configured."""
        if not self.allows_host(host):
            raise TrustError(f"{what} would listen on {host}, which other hosts can reach, but no deployment "
                             f"secret is configured (only this user's local one, for loopback): set {SECRET_ENV} "
                             f"or {SECRET_FILE_ENV} to the same secret on every engine and router (docs/SECURITY.md)")


def _local_dir() -> Path:
    # One place per user, whatever the process's environment: every local process must find the same file.
    return Path(os.environ.get("KVSHUTTLE_LOCAL_SECRET_DIR") or Path.home() / ".cache" / "kvshuttle")
