"""What a handle may look like before the router stores it, and where it is stored.

A backend's ``kv_transfer_params`` are checked before they are kept: kvshuttle's strictly, with the wire
format's own parser (:meth:`KVHandle.from_kv_transfer_params`), and authenticated: a handle whose
``kvshuttle_mac`` does not verify under the deployment secret (forged, edited, or from a decode of another
deployment) is refused (reason ``unauthenticated``); vLLM NixlConnector's by the field names and types vLLM
reads (it signs nothing). Anything else is dropped and counted, never forwarded. Client-supplied params are never
looked at at all. A handle is stored under (tenant, conversation): it never reaches another tenant.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from ..policy.kv_handle import HandleAuthError, HandleFormatError, KVHandle
from ..trust import DeploymentSecret
from .config import Connector

#: What prefill gets when the router holds nothing for the conversation (vLLM's toy and multi-turn proxies).
FIRST_TURN_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None,
}
MAX_PARAMS_BYTES = 1 << 20  # 1 MiB of JSON: ~100k blocks with kvshuttle's digests; beyond is not a handle
MAX_ID_LENGTH = 256


class InvalidHandle(Exception):
    """A backend's params that will not be stored; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def checked_handle(params: Any, connector: Connector,
                   secret: DeploymentSecret | None) -> tuple[dict[str, Any], float]:
    """The params to store and their remaining life in seconds (inf: the router's TTL decides).

    Raises :class:`InvalidHandle` for anything malformed, unauthenticated under ``secret`` (kvshuttle's
    handles; None skips the MAC check, for tests of the format only) or already expired.
    """
    if not isinstance(params, dict):
        raise InvalidHandle("not_a_dict", f"kv_transfer_params are a {type(params).__name__}")
    try:
        size = len(json.dumps(params))
    except (TypeError, ValueError) as exc:
        raise InvalidHandle("not_json", f"kv_transfer_params are not plain JSON: {exc}") from None
    if size > MAX_PARAMS_BYTES:
        raise InvalidHandle("too_large", f"kv_transfer_params of {size} bytes")
    if connector == "kvshuttle":
        try:
            handle = KVHandle.from_kv_transfer_params(params, secret)
        except HandleAuthError as exc:
            raise InvalidHandle("unauthenticated", str(exc)) from None
        except HandleFormatError as exc:
            raise InvalidHandle("malformed", str(exc)) from None
        # The decode's own TTL for these blocks, clock-free; a handle issued already dead is not worth a turn.
        if handle.ttl_s <= 0:
            raise InvalidHandle("expired", "the decode issued the handle with no retention left")
        return dict(params), handle.ttl_s
    _check_nixl(params)
    return dict(params), float("inf")


def _check_nixl(params: dict[str, Any]) -> None:
    """The fields vLLM's NixlConnector reads from a decode's params on the next prefill."""
    engine, host, port = params.get("remote_engine_id"), params.get("remote_host"), params.get("remote_port")
    ids = params.get("remote_block_ids")
    if not isinstance(engine, str) or not engine:
        raise InvalidHandle("malformed", "remote_engine_id must be a non-empty string")
    if not isinstance(host, str) or not host:
        raise InvalidHandle("malformed", "remote_host must be a non-empty string")
    if type(port) is not int or not 0 < port < 65536:
        raise InvalidHandle("malformed", "remote_port must be an int in [1, 65535]")
    if not isinstance(ids, list) or not ids or any(type(b) is not int or b < 0 for b in ids):
        raise InvalidHandle("malformed", "remote_block_ids must be a non-empty list of non-negative ints")
    for name in ("do_remote_decode", "do_remote_prefill"):
        if name in params and not isinstance(params[name], bool):
            raise InvalidHandle("malformed", f"{name} must be a bool")


def prefill_params(handle: dict[str, Any] | None) -> dict[str, Any]:
    """``kv_transfer_params`` for a turn's prefill: the stored decode handle (read back), or turn 1's."""
    if handle is None:
        return dict(FIRST_TURN_PARAMS)
    return {**handle, "do_remote_decode": True, "do_remote_prefill": False}


@functools.lru_cache(maxsize=4096)  # a turn needs its key several times (lookup, stream, store)
def store_key(tenant: str, conversation: str) -> str:
    """A fixed-size key per (tenant, conversation); length-prefixed, so no pair of strings collides by joining."""
    raw = f"{len(tenant)}:{tenant}|{conversation}".encode()
    return hashlib.blake2b(raw, digest_size=20).hexdigest()


def valid_id(value: Any) -> str | None:
    """A conversation id or tenant as given by a client, or None when it is not a short printable string."""
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and value.isprintable():
        return value
    return None
