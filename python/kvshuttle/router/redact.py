"""Secrets the router holds (the Redis password, API keys, the backends' key): read from the environment or a
file, and kept out of every log line and error body.

* :func:`redact_url` shows a store URL with its password (and a bare user, which Redis URLs may use as one)
  replaced by ``***``: the form every log line and error message uses.
* :func:`register` adds a secret to the process-wide list that :func:`scrub` replaces with ``***``, and
  :class:`RedactingFilter` (installed on the router's and aiohttp's loggers by :func:`install_filter`) scrubs
  each record's message, its ``kv`` fields and its traceback before any handler formats it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from .errors import RouterConfigError

MASK = "***"
REDIS_URL_ENV = "KVSHUTTLE_REDIS_URL"
BACKEND_API_KEY_ENV = "KVSHUTTLE_BACKEND_API_KEY"
ADMIN_KEY_ENV = "KVSHUTTLE_ROUTER_ADMIN_KEY"
SECRET_QUERY_KEYS = ("password", "pass", "passwd", "pwd", "token", "secret", "auth")
LOGGERS = ("kvshuttle.router", "aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.client", "redis")

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()  # longest first, so a secret containing another is masked whole


def register(values: Iterable[str | None]) -> None:
    """Mask these strings in every log line from now on (process-wide; empty values are ignored)."""
    global _secrets
    with _lock:
        known = set(_secrets)
        known.update(v for v in values if isinstance(v, str) and v)
        _secrets = tuple(sorted(known, key=len, reverse=True))


def scrub(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def url_secrets(url: str) -> list[str]:
    """The parts of a store URL to mask in any text: its password (raw and decoded) and secret query values.

    (A bare user, ``redis://name@host``, is a user name to Redis: :func:`redact_url` hides it, but it is not
    masked everywhere, where a name like ``default`` would garble every log line.)"""
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return [url]  # unparsable: the whole URL is treated as secret
    found: list[str] = []
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    _, sep, password = userinfo.partition(":")
    if sep:
        found += [password, unquote(password)]
    found += [v for k, v in query if k.lower() in SECRET_QUERY_KEYS]
    return [v for v in found if v]


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (``redis://:***@host:6379/0``); safe to log or show."""
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return "<an unparsable URL, not shown>"
    shown = url
    prefix = f"{parts.scheme}://"
    if "@" in parts.netloc and shown.startswith(prefix):
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{hostport}" if sep else f"{MASK}@{hostport}"
        shown = prefix + netloc + shown[len(prefix) + len(parts.netloc):]
    if any(k.lower() in SECRET_QUERY_KEYS for k, _ in query):
        masked = urlencode([(k, MASK if k.lower() in SECRET_QUERY_KEYS else v) for k, v in query], safe="*")
        shown = shown.partition("?")[0] + "?" + masked + (f"#{parts.fragment}" if parts.fragment else "")
    if any(secret in shown for secret in url_secrets(url)):  # an encoding this function does not know
        return "<a URL with a password, not shown>"
    return shown


def has_password(url: str) -> bool:
    """Whether ``url`` carries credentials (what must not be passed on a command line)."""
    return bool(url_secrets(url)) or redact_url(url) != url


def read_secret_file(path: str | os.PathLike[str], what: str) -> str:
    """A secret kept in a file (surrounding whitespace ignored); the error never shows the file's content."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise RouterConfigError(f"cannot read {what} from {os.fspath(path)}: {why}") from None
    if not text:
        raise RouterConfigError(f"{os.fspath(path)} is empty; it must hold {what}")
    return text


def one_source(what: str, sources: Mapping[str, str | None], env: str, environ: Mapping[str, str]) -> str | None:
    """The value given by at most one of ``sources`` (flag -> value), else the environment variable ``env``."""
    given = {name: value for name, value in sources.items() if value}
    if len(given) > 1:
        raise RouterConfigError(f"give {what} once, not with {' and '.join(given)}")
    if given:
        return next(iter(given.values()))
    return environ.get(env) or None


class RedactingFilter(logging.Filter):
    """Masks the registered secrets in a record's message, ``kv`` fields and traceback (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: the handler reports it; nothing to mask here
            return True
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        fields = getattr(record, "kv", None)
        if isinstance(fields, dict):
            record.kv = {k: scrub(v) if isinstance(v, str) else v for k, v in fields.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True


_FILTER = RedactingFilter()


def install_filter(names: Iterable[str] = LOGGERS) -> None:
    """Put the redacting filter on these loggers (idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
